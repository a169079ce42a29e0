//! The `dedup` section of the admission gate's policy (documented in
//! `policies/admission-gate.md`). Present means enabled.

use crate::validate::{ensure, header_name, Fields, PolicyError, Warning, Warnings};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

use super::table::ENTRIES_PER_PAGE;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct DedupDoc {
    window_ms: Option<u64>,
    max_body_bytes: Option<u64>,
    max_entries: Option<u64>,
    scope: Option<Scope>,
    api_key_header: Option<String>,
    methods: Option<Vec<String>>,
    exclude: Option<Vec<String>>,
    global_methods: Option<Vec<String>>,
    reuse_methods: Option<Vec<String>>,
    max_wait_ms: Option<u64>,
    max_waiters: Option<u64>,
    max_answer_bytes: Option<u64>,
    #[serde(default)]
    upstream: UpstreamDoc,
    engage_after_ms: Option<u64>,
    standby_after_ms: Option<u64>,
}

/// Where a coalesced request's leader is sent: the cluster of Envoy's
/// config that the route sends to, and how long it may take.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(crate) struct UpstreamDoc {
    cluster: Option<String>,
    timeout_ms: Option<u64>,
}

/// Whose requests can be duplicates of each other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Scope {
    /// Only the same client's: by API key (hashed) if it sends one, else
    /// by its address.
    #[default]
    Client,
    /// Anyone's.
    Global,
}

/// Methods whose answer depends only on their params and the chain, so a
/// retry within the window wants what the original is already fetching.
/// Methods that are polled for a changing answer with no params
/// (`eth_blockNumber`, `eth_gasPrice`, `eth_syncing`, filters) are left
/// out: a poll faster than the window would be refused.
pub const READ_ONLY_METHODS: &[&str] = &[
    "eth_call",
    "eth_estimateGas",
    "eth_getBalance",
    "eth_getBlockByHash",
    "eth_getBlockByNumber",
    "eth_getBlockReceipts",
    "eth_getCode",
    "eth_getLogs",
    "eth_getProof",
    "eth_getStorageAt",
    "eth_getTransactionByHash",
    "eth_getTransactionCount",
    "eth_getTransactionReceipt",
    "debug_traceCall",
    "debug_traceTransaction",
    "trace_block",
    "trace_transaction",
    // Solana's (`getSlot`, `getBlockHeight`, `getLatestBlockhash` and
    // `getSignatureStatuses` are polled, and left out).
    "getAccountInfo",
    "getBalance",
    "getBlock",
    "getMultipleAccounts",
    "getProgramAccounts",
    "getSignaturesForAddress",
    "getTokenAccountBalance",
    "getTokenAccountsByOwner",
    "getTransaction",
    "simulateTransaction",
];

/// The same signed transaction is a duplicate whoever sends it (only while
/// the first is in flight for Solana's `sendTransaction`: a client that
/// sends it again wants it sent again, and it is not reused).
pub const GLOBAL_METHODS: &[&str] = &["eth_sendRawTransaction", "sendTransaction"];

/// Methods whose found answer cannot change once its block is final: by
/// block or transaction hash; and a sent transaction's hash, which never
/// can (`dedup::Reuse`).
pub const REUSE_METHODS: &[&str] = &[
    "eth_getBlockByHash",
    "eth_getTransactionByHash",
    "eth_getTransactionReceipt",
    "debug_traceTransaction",
    "trace_transaction",
    "eth_sendRawTransaction",
    "getTransaction",
    "getBlock",
];

/// Methods whose answer depends on the request alone: served again
/// whatever the chain does.
pub const ALWAYS_REUSE: &[&str] = &["eth_sendRawTransaction"];

/// Solana's methods whose found answer cannot change when it was asked for
/// at the `finalized` commitment (Solana's default): a finalized
/// transaction or block. At `confirmed` or `processed` it can (a fork), and
/// is not served again.
pub const FINALIZED_REUSE: &[&str] = &["getTransaction", "getBlock"];

/// Larger bodies would have Envoy's default buffer limit (1 MiB) answer
/// 413 while the gate waits for the end of the body.
pub const MAX_BODY_BYTES_LIMIT: u64 = 1024 * 1024;
pub const MAX_WINDOW_MS: u64 = 600_000;
pub const MAX_ENTRIES_LIMIT: u64 = 1 << 20;
/// Names in one method list.
pub const MAX_METHODS: usize = 1024;
pub const MAX_ANSWER_BYTES_LIMIT: u64 = 4 * 1024 * 1024;
pub const MAX_WAITERS_LIMIT: u64 = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupPolicy {
    pub window_ms: u64,
    pub max_body_bytes: u64,
    /// Shared-data pages of `ENTRIES_PER_PAGE` entries.
    pub pages: u32,
    pub scope: Scope,
    pub api_key_header: String,
    pub methods: BTreeSet<String>,
    pub global_methods: BTreeSet<String>,
    /// Methods whose answer, once found, is given to identical requests
    /// for `window_ms`.
    pub reuse_methods: BTreeSet<String>,
    /// How long a request waits for an identical one's answer.
    pub max_wait_ms: u64,
    /// Requests that may wait for one answer, on every VM together.
    pub max_waiters: u32,
    /// Answers larger than this are not shared between workers or kept.
    pub max_answer_bytes: u64,
    pub upstream: Upstream,
    /// Coalescing engages once a request has been at the node this long
    /// (0: always engaged), and stands by again after `standby_after_ms`
    /// with none (`dedup::engage`).
    pub engage_after_ms: u64,
    pub standby_after_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub cluster: String,
    pub timeout_ms: u64,
}

/// A list of method names, checked.
fn names(field: &str, list: Vec<String>) -> Result<BTreeSet<String>, PolicyError> {
    ensure(list.len() <= MAX_METHODS, &format!("dedup.{field}"), || {
        format!("at most {MAX_METHODS} methods; got {}", list.len())
    })?;
    list.into_iter()
        .enumerate()
        .map(|(i, m)| {
            let method_name = !m.is_empty()
                && m.len() <= 128
                && m.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\');
            ensure(method_name, &format!("dedup.{field}[{i}]"), || {
                format!("must be a method name; got {m:?}")
            })?;
            Ok(m)
        })
        .collect()
}

/// The methods deduplicated, those in `global` scope, and those whose
/// answers are reused.
fn methods(doc: &DedupDoc, f: &mut Fields) -> Result<Methods, PolicyError> {
    let defaults = |list: &[&str]| list.iter().map(|m| m.to_string()).collect();
    let mut methods = names(
        "methods",
        f.or_else(
            "dedup.methods",
            doc.methods.clone(),
            "read-only methods, Ethereum's and Solana's, + `eth_sendRawTransaction` and `sendTransaction`",
            || defaults(&[READ_ONLY_METHODS, GLOBAL_METHODS].concat()),
        ),
    )?;
    let exclude = f.or_else("dedup.exclude", doc.exclude.clone(), "[]", Vec::new);
    for m in names("exclude", exclude)? {
        methods.remove(&m);
    }
    ensure(!methods.is_empty(), "dedup.methods", || {
        "no method is left to deduplicate; remove the dedup section to turn it off".into()
    })?;
    let global = f.or(
        "dedup.globalMethods",
        doc.global_methods.clone(),
        defaults(GLOBAL_METHODS),
    );
    let reuse = f.or_else(
        "dedup.reuseMethods",
        doc.reuse_methods.clone(),
        "by-hash reads, `eth_sendRawTransaction`, and Solana's `getTransaction` and `getBlock` (below)",
        || defaults(REUSE_METHODS),
    );
    Ok((
        methods,
        names("globalMethods", global)?,
        names("reuseMethods", reuse)?,
    ))
}

type Methods = (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>);

/// Where a leader's callout goes.
fn upstream(doc: UpstreamDoc, f: &mut Fields) -> Result<Upstream, PolicyError> {
    let cluster = f.or("dedup.upstream.cluster", doc.cluster, "rpc_node".into());
    ensure(
        !cluster.is_empty()
            && cluster.len() <= 256
            && cluster.bytes().all(|b| b.is_ascii_graphic()),
        "dedup.upstream.cluster",
        || format!("must be the name of a cluster in Envoy's config; got {cluster:?}"),
    )?;
    let timeout_ms = f.range(
        "dedup.upstream.timeoutMs",
        doc.timeout_ms,
        60_000,
        1,
        MAX_WINDOW_MS,
    )?;
    Ok(Upstream {
        cluster,
        timeout_ms,
    })
}

impl DedupPolicy {
    pub(crate) fn compile(doc: DedupDoc, f: &mut Fields) -> Result<Self, PolicyError> {
        let (methods, global_methods, reuse_methods) = methods(&doc, f)?;
        let window_ms = f.range("dedup.windowMs", doc.window_ms, 1000, 1, MAX_WINDOW_MS)?;
        let max_wait_ms = f.range("dedup.maxWaitMs", doc.max_wait_ms, 20_000, 1, MAX_WINDOW_MS)?;
        let max_waiters = f.range(
            "dedup.maxWaiters",
            doc.max_waiters,
            256,
            1,
            MAX_WAITERS_LIMIT,
        )?;
        let max_answer_bytes = f.range(
            "dedup.maxAnswerBytes",
            doc.max_answer_bytes,
            128 * 1024,
            0,
            MAX_ANSWER_BYTES_LIMIT,
        )?;
        let upstream = upstream(doc.upstream, f)?;
        let max_body_bytes = f.range(
            "dedup.maxBodyBytes",
            doc.max_body_bytes,
            64 * 1024,
            2,
            MAX_BODY_BYTES_LIMIT,
        )?;
        let max_entries = f.range(
            "dedup.maxEntries",
            doc.max_entries,
            4096,
            ENTRIES_PER_PAGE as u64,
            MAX_ENTRIES_LIMIT,
        )?;
        let scope = f.or("dedup.scope", doc.scope, Scope::Client);
        let api_key_header = header_name(
            "dedup.apiKeyHeader",
            f.or("dedup.apiKeyHeader", doc.api_key_header, "x-api-key".into()),
        )?;
        let engage_after_ms =
            f.range("dedup.engageAfterMs", doc.engage_after_ms, 100, 0, 60_000)?;
        let standby_after_ms = f.range(
            "dedup.standbyAfterMs",
            doc.standby_after_ms,
            5000,
            engage_after_ms.max(super::engage::TICK_MS),
            MAX_WINDOW_MS,
        )?;
        Ok(Self {
            window_ms,
            max_body_bytes,
            pages: max_entries.div_ceil(ENTRIES_PER_PAGE as u64) as u32,
            scope,
            api_key_header,
            methods,
            global_methods,
            reuse_methods,
            max_wait_ms,
            max_waiters: max_waiters as u32,
            max_answer_bytes,
            upstream,
            engage_after_ms,
            standby_after_ms,
        })
    }

    /// Values that are valid but probably a mistake.
    pub fn warnings(&self) -> Vec<Warning> {
        let mut w = Warnings::default();
        w.when(self.window_ms > 10_000, "dedup.windowMs", || {
            format!(
                "{} ms: an answer no client stayed for is given to an identical request this long after (a retry, but also a later poll)",
                self.window_ms
            )
        });
        w.when(self.max_wait_ms > 30_000, "dedup.maxWaitMs", || {
            format!(
                "{} ms is past the shipped configs' request_timeout (30 s): Envoy ends a waiting request first",
                self.max_wait_ms
            )
        });
        w.0
    }

    /// Entries the table holds at most.
    pub fn max_entries(&self) -> u64 {
        u64::from(self.pages) * ENTRIES_PER_PAGE as u64
    }
}
