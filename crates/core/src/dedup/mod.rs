//! Retry-storm protection (docs/background.md part 4, Agave's outstanding-request
//! map, at the gateway): a request identical to one the node is still
//! working on is not sent upstream again. The duplicate gets 429 with
//! `retry-after` set to what is left of the window.
//!
//! - `key`: what makes two requests the same (scope, method, canonical
//!   params; never the JSON-RPC id).
//! - `table`: the shared-data pages of outstanding requests.
//! - `policy`: the `dedup` section of the gate's policy.
//!
//! **An entry's life.** It is written when its request is sent upstream
//! (`check`) and blocks its key while the request is in flight. When the
//! stream ends (`complete`):
//! - answered (any status): the entry goes at once. The node is done with
//!   it, and an identical request after it (a receipt poll, a balance at
//!   `latest`) wants a fresh answer, not a refusal;
//! - abandoned (its client reset first): the node may still be working on
//!   it, so the entry blocks until `start + window`. This is the retry
//!   storm: a client that times out and sends the same call again.
//!
//! While in flight, an entry blocks for as long as its owner, the gate VM
//! that sent it, is alive in the gate's shard table. A completion is lost
//! only if its VM vanished (Envoy ends every stream of a live VM); then the
//! owner's shard stops heartbeating, and after three missed heartbeats the
//! entry blocks only until `start + window`. So a lost completion cannot
//! block a key beyond the later of the window and three heartbeats.
//!
//! **Failure is open.** A full page, a store error, or an unreadable body
//! lets the request pass: dedup never refuses a request it is not sure is
//! a duplicate.

pub mod key;
pub mod policy;
pub mod table;

use crate::gate::shards::ShardTable;
use crate::gate::SHARED_KEY as SHARDS_KEY;
use crate::rejection::{Rejection, LIMIT_EXCEEDED};
use crate::request::{sha256_hex, RequestFacts};
use crate::shared::{read, update, Change, SharedStore, StoreError};
use key::{Body, Key, Unkeyed};
use policy::{DedupPolicy, Scope};
use table::{page_of, Entry, Page, ENTRIES_PER_PAGE};

/// The shared-data key of page `index`.
pub fn page_key(index: u32) -> String {
    format!("stakegate.admission_gate.v1.dedup.{index}")
}

/// An owner that missed this many heartbeats no longer holds its entries
/// in flight.
pub const MISSED_HEARTBEATS: u64 = 3;

/// Why a request is not checked; it passes as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    Body(Unkeyed),
    /// A method the policy does not deduplicate.
    Method,
}

/// A body's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keyed {
    pub key: Key,
}

/// An entry this VM wrote; `complete` it when the stream ends.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an entry written stays in flight until it is completed"]
pub struct Pending {
    key: Key,
    start_ms: u64,
    owner: u32,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a duplicate: send it (its entry is written).
    Send(Pending),
    /// A duplicate: answer 429.
    Duplicate(Rejection),
    /// Its page has no room: send it, unrecorded.
    TableFull,
}

/// A verdict plus what the filter counts.
#[derive(Debug, PartialEq, Eq)]
pub struct Checked {
    pub verdict: Verdict,
    /// Expired entries removed on the way.
    pub purged: u64,
    pub cas_retries: u32,
}

/// What a sweep of the whole table found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sweep {
    pub entries: u64,
    pub purged: u64,
    pub cas_retries: u32,
}

/// One gate VM's side of dedup.
#[derive(Debug, Clone)]
pub struct Dedup {
    policy: DedupPolicy,
    /// How stale an owner's heartbeat may be before its in-flight entries
    /// stop blocking past the window.
    owner_max_age_ms: u64,
    retry_after_max_s: u32,
}

/// Which gate VMs are alive, from the shard table, read at most once.
struct Owners<'s, S> {
    store: &'s S,
    me: u32,
    now_ms: u64,
    max_age_ms: u64,
    table: Option<Option<ShardTable>>,
}

impl<S: SharedStore> Owners<'_, S> {
    /// Unknown (the table cannot be read) counts as gone: dedup fails open.
    fn alive(&mut self, vm: u32) -> bool {
        if vm == self.me {
            return true;
        }
        let store = self.store;
        let table = self
            .table
            .get_or_insert_with(|| read::<ShardTable>(store, SHARDS_KEY).ok().map(|(t, _)| t));
        table.as_ref().is_some_and(|t| {
            t.shards.iter().any(|s| {
                s.vm == vm && self.now_ms.saturating_sub(s.heartbeat_ms) <= self.max_age_ms
            })
        })
    }
}

/// How long an entry still blocks its key: `Some(Some(ms))`, `Some(None)`
/// for as long as it stays in flight, or `None` when it has expired.
fn blocking<S: SharedStore>(
    e: &Entry,
    now_ms: u64,
    window_ms: u64,
    owners: &mut Owners<'_, S>,
) -> Option<Option<u64>> {
    let window_end = e.start_ms.saturating_add(window_ms);
    let until = if e.in_flight() {
        if now_ms < window_end {
            window_end
        } else if owners.alive(e.owner) {
            return Some(None);
        } else {
            return None;
        }
    } else {
        e.end_ms.max(window_end)
    };
    (now_ms < until).then(|| Some(until - now_ms))
}

impl Dedup {
    /// `heartbeat_ms` and `retry_after_max_s` come from the gate's policy.
    pub fn new(policy: DedupPolicy, heartbeat_ms: u64, retry_after_max_s: u32) -> Self {
        Self {
            policy,
            owner_max_age_ms: MISSED_HEARTBEATS * heartbeat_ms,
            retry_after_max_s,
        }
    }

    pub fn policy(&self) -> &DedupPolicy {
        &self.policy
    }

    /// Whether a body of `content_length` bytes could be checked.
    pub fn fits(&self, content_length: u64) -> bool {
        content_length <= self.policy.max_body_bytes
    }

    /// The key of a request body, or why it has none. `client` is the
    /// sender's name for `client` scope (`client_name`, read with the
    /// headers: Envoy serves no headers during the body phase).
    pub fn key(&self, body: &[u8], client: &str) -> Result<Keyed, Skip> {
        let parsed = Body::parse(body).map_err(Skip::Body)?;
        let calls = parsed.calls().ok_or(Skip::Body(Unkeyed::NotJsonRpc))?;
        let policy = &self.policy;
        if !calls.iter().all(|c| policy.methods.contains(c.method)) {
            return Err(Skip::Method);
        }
        let global = policy.scope == Scope::Global
            || calls
                .iter()
                .all(|c| policy.global_methods.contains(c.method));
        let scope = if global { "global" } else { client };
        Ok(Keyed {
            key: parsed.key(scope),
        })
    }

    /// Checks `keyed` against the table as gate VM `vm`, and records it if
    /// it is to be sent.
    pub fn check(
        &self,
        store: &impl SharedStore,
        keyed: &Keyed,
        vm: u32,
        now_ms: u64,
    ) -> Result<Checked, StoreError> {
        let window = self.policy.window_ms;
        let mut owners = self.owners(store, vm, now_ms);
        let page = page_key(page_of(&keyed.key, self.policy.pages));
        let updated = update(store, &page, |page: &mut Page| {
            let mut found = None;
            let before = page.entries.len();
            page.entries.retain(|e| match blocking(e, now_ms, window, &mut owners) {
                None => false,
                Some(left) => {
                    if e.key == keyed.key {
                        found = Some(left);
                    }
                    true
                }
            });
            let purged = (before - page.entries.len()) as u64;
            let verdict = match found {
                Some(left) => Verdict::Duplicate(Rejection::new(
                    Rejection::TOO_MANY_REQUESTS,
                    self.retry_after_s(left),
                    LIMIT_EXCEEDED,
                    "duplicate request: the node is still working on an identical request; retry after the retry-after header",
                )),
                None if page.entries.len() < ENTRIES_PER_PAGE => {
                    page.entries.push(Entry {
                        key: keyed.key,
                        start_ms: now_ms,
                        end_ms: 0,
                        owner: vm,
                    });
                    Verdict::Send(Pending {
                        key: keyed.key,
                        start_ms: now_ms,
                        owner: vm,
                    })
                }
                None => Verdict::TableFull,
            };
            if purged > 0 || matches!(verdict, Verdict::Send(_)) {
                Change::Write((verdict, purged))
            } else {
                Change::Keep((verdict, purged))
            }
        })
        .map_err(|(e, _)| e)?;
        let (verdict, purged) = updated.value;
        Ok(Checked {
            verdict,
            purged,
            cas_retries: updated.retries,
        })
    }

    /// The request `pending` ended. If it was `answered` (whatever the
    /// status), its entry goes at once: the node is done with it, and an
    /// identical request after it wants a fresh answer (a receipt poll, a
    /// balance at `latest`). If its client went first (a reset), the node
    /// may still be working on it, so the entry blocks the key until the
    /// window ends. Returns entries purged (1 if the entry went).
    pub fn complete(
        &self,
        store: &impl SharedStore,
        pending: Pending,
        now_ms: u64,
        answered: bool,
    ) -> Result<(u64, u32), StoreError> {
        let page = page_key(page_of(&pending.key, self.policy.pages));
        let window_end = pending.start_ms.saturating_add(self.policy.window_ms);
        let updated = update(store, &page, |page: &mut Page| {
            let Some(i) = page.entries.iter().position(|e| {
                e.key == pending.key && e.owner == pending.owner && e.start_ms == pending.start_ms
            }) else {
                return Change::Keep(0);
            };
            if now_ms >= window_end || answered {
                page.entries.swap_remove(i);
                Change::Write(1)
            } else {
                // 0 means in flight; a clock at 0 still completes.
                page.entries[i].end_ms = now_ms.max(1);
                Change::Write(0)
            }
        })
        .map_err(|(e, _)| e)?;
        Ok((updated.value, updated.retries))
    }

    /// Purges expired entries from every page and counts what is left.
    /// Called on the heartbeat; a page's first failure ends the sweep.
    pub fn sweep(
        &self,
        store: &impl SharedStore,
        vm: u32,
        now_ms: u64,
    ) -> Result<Sweep, StoreError> {
        let window = self.policy.window_ms;
        let mut owners = self.owners(store, vm, now_ms);
        let mut sweep = Sweep::default();
        for index in 0..self.policy.pages {
            let updated = update(store, &page_key(index), |page: &mut Page| {
                let before = page.entries.len();
                page.entries
                    .retain(|e| blocking(e, now_ms, window, &mut owners).is_some());
                let purged = (before - page.entries.len()) as u64;
                if purged > 0 {
                    Change::Write(purged)
                } else {
                    Change::Keep(0)
                }
            })
            .map_err(|(e, _)| e)?;
            sweep.purged += updated.value;
            sweep.entries += updated.table.entries.len() as u64;
            sweep.cas_retries += updated.retries;
        }
        Ok(sweep)
    }

    fn owners<'s, S: SharedStore>(&self, store: &'s S, me: u32, now_ms: u64) -> Owners<'s, S> {
        Owners {
            store,
            me,
            now_ms,
            max_age_ms: self.owner_max_age_ms,
            table: None,
        }
    }

    fn retry_after_s(&self, left_ms: Option<u64>) -> u32 {
        let seconds = left_ms.map_or(1, |ms| ms.div_ceil(1000).max(1));
        seconds.min(u64::from(self.retry_after_max_s)) as u32
    }
}

/// A client's name for `client` scope: its API key's hash when it sends
/// one, else its address. (The key need not be known to the gate: a client
/// that sends someone else's key shares only that key's dedup scope, which
/// requires knowing the key.)
pub fn client_name(policy: &DedupPolicy, facts: &mut impl RequestFacts) -> String {
    if let Some(key) = facts.header(&policy.api_key_header) {
        return format!("key:{}", sha256_hex(key.as_bytes()));
    }
    match facts.source_ip() {
        Some(ip) => format!("addr:{ip}"),
        None => "anonymous".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gate::policy::GatePolicy;
    use crate::gate::shards::Shard;
    use crate::request::MetadataScope;
    use crate::shared::MemoryStore;
    use std::net::IpAddr;

    struct Client {
        ip: &'static str,
        key: Option<&'static str>,
    }

    impl RequestFacts for Client {
        fn metadata_class(&mut self, _: MetadataScope) -> Option<String> {
            None
        }
        fn source_ip(&mut self) -> Option<IpAddr> {
            self.ip.parse().ok()
        }
        fn peer_uri_san(&mut self) -> Option<String> {
            None
        }
        fn header(&mut self, name: &str) -> Option<String> {
            self.key.filter(|_| name == "x-api-key").map(str::to_string)
        }
    }

    const ALICE: Client = Client {
        ip: "192.0.2.1",
        key: None,
    };

    fn dedup(section: &str) -> Dedup {
        let policy =
            GatePolicy::parse(format!(r#"{{"maxInflight": 100, "dedup": {section}}}"#).as_bytes())
                .unwrap();
        Dedup::new(policy.dedup.unwrap(), 1000, 30)
    }

    fn call(params: &str) -> String {
        format!(r#"{{"jsonrpc":"2.0","id":7,"method":"eth_call","params":[{params}]}}"#)
    }

    fn name(dedup: &Dedup, mut client: Client) -> String {
        client_name(dedup.policy(), &mut client)
    }

    fn keyed(dedup: &Dedup, body: &str, client: Client) -> Keyed {
        dedup.key(body.as_bytes(), &name(dedup, client)).unwrap()
    }

    fn verdict(d: &Dedup, store: &MemoryStore, keyed: &Keyed, vm: u32, now: u64) -> Verdict {
        d.check(store, keyed, vm, now).unwrap().verdict
    }

    fn retry_after(verdict: &Verdict) -> Option<u32> {
        match verdict {
            Verdict::Duplicate(rejection) => Some(rejection.retry_after_s),
            _ => None,
        }
    }

    fn pending(verdict: Verdict) -> Pending {
        match verdict {
            Verdict::Send(p) => p,
            other => panic!("expected Send, got {other:?}"),
        }
    }

    /// Gate VMs with these heartbeats, as the gate's heartbeat writes them.
    fn shards(store: &MemoryStore, beats: &[(u32, u64)]) {
        let table = ShardTable {
            next_vm: 100,
            completions: 0,
            shards: beats
                .iter()
                .map(|&(vm, heartbeat_ms)| Shard {
                    vm,
                    heartbeat_ms,
                    ..Shard::default()
                })
                .collect(),
        };
        store.store(SHARDS_KEY, &table.encode(), None).unwrap();
    }

    #[test]
    fn a_duplicate_is_refused_in_flight_and_within_the_window() {
        let (d, store) = (dedup(r#"{"windowMs": 2500}"#), MemoryStore::default());
        let a = keyed(&d, &call("1"), ALICE);
        let sent = pending(verdict(&d, &store, &a, 1, 10_000));
        let dup = verdict(&d, &store, &a, 1, 10_100);
        assert_eq!(retry_after(&dup), Some(3), "2.4 s left rounds up");
        let Verdict::Duplicate(rejection) = dup else {
            unreachable!()
        };
        let body = rejection.answering(call("1").as_bytes()).body;
        assert!(
            body.contains(r#""id":7"#) && body.contains("-32005") && body.contains("duplicate")
        );
        // Another request, or the same from another client, is not a duplicate.
        let b = keyed(&d, &call("2"), ALICE);
        let answered = pending(verdict(&d, &store, &b, 1, 10_100));
        let bob = Client {
            ip: "192.0.2.2",
            key: None,
        };
        let _in_flight = pending(verdict(&d, &store, &keyed(&d, &call("1"), bob), 1, 10_100));
        // Answered, an entry goes at once: the next identical request
        // wants a fresh answer.
        assert_eq!(d.complete(&store, answered, 10_200, true).unwrap().0, 1);
        let _in_flight = pending(verdict(&d, &store, &b, 1, 10_201));
        // Abandoned by its client, it blocks until the window ends (the
        // node may still be working on it)...
        assert_eq!(d.complete(&store, sent, 10_300, false).unwrap().0, 0);
        assert_eq!(retry_after(&verdict(&d, &store, &a, 1, 12_000)), Some(1));
        // ...which ends at start + window.
        let checked = d.check(&store, &a, 1, 12_500).unwrap();
        assert!(matches!(checked.verdict, Verdict::Send(_)));
        assert_eq!(checked.purged, 1);
    }

    #[test]
    fn a_slow_original_blocks_until_it_completes() {
        let (d, store) = (dedup(r#"{"windowMs": 1000}"#), MemoryStore::default());
        let a = keyed(&d, &call("1"), ALICE);
        let sent = pending(verdict(&d, &store, &a, 1, 0));
        // VM 1 is alive (heartbeat 4.5 s): VM 2 sees the entry in flight.
        shards(&store, &[(1, 4500), (2, 4500)]);
        assert_eq!(retry_after(&verdict(&d, &store, &a, 2, 5000)), Some(1));
        assert_eq!(d.sweep(&store, 2, 5000).unwrap().entries, 1);
        // Abandoned after its window, the entry goes at once.
        assert_eq!(d.complete(&store, sent, 6000, false).unwrap().0, 1);
        let _in_flight = pending(verdict(&d, &store, &a, 2, 6001));
    }

    #[test]
    fn a_lost_completion_stops_blocking_when_the_window_expires() {
        let (d, store) = (dedup(r#"{"windowMs": 5000}"#), MemoryStore::default());
        let a = keyed(&d, &call("1"), ALICE);
        // VM 1 sends, then vanishes: its last heartbeat is at 0, and its
        // stream never completes.
        shards(&store, &[(1, 0), (2, 4900)]);
        let _in_flight = pending(verdict(&d, &store, &a, 1, 0));
        assert_eq!(retry_after(&verdict(&d, &store, &a, 2, 4999)), Some(1));
        let checked = d.check(&store, &a, 2, 5000).unwrap();
        assert!(matches!(checked.verdict, Verdict::Send(_)), "{checked:?}");
        assert_eq!(checked.purged, 1);
        // A sweep purges lost entries too.
        let b = keyed(&d, &call("2"), ALICE);
        let _in_flight = pending(verdict(&d, &store, &b, 1, 100));
        let sweep = d.sweep(&store, 2, 5100).unwrap();
        assert_eq!((sweep.purged, sweep.entries), (1, 1));
    }

    #[test]
    fn a_full_table_lets_requests_pass_and_sweeps_empty_it() {
        let (d, store) = (
            dedup(r#"{"windowMs": 1000, "maxEntries": 64}"#),
            MemoryStore::default(),
        );
        assert_eq!(d.policy().max_entries(), 64);
        let keys: Vec<Keyed> = (0..65)
            .map(|i| keyed(&d, &call(&i.to_string()), ALICE))
            .collect();
        let sent: Vec<Pending> = keys[..64]
            .iter()
            .map(|k| pending(verdict(&d, &store, k, 1, 0)))
            .collect();
        assert_eq!(verdict(&d, &store, &keys[64], 1, 10), Verdict::TableFull);
        // Still refused as a duplicate while the table is full.
        assert_eq!(retry_after(&verdict(&d, &store, &keys[0], 1, 10)), Some(1));
        // In flight, they stay however old; abandoned, their window ends them.
        assert_eq!(d.sweep(&store, 1, 400).unwrap().entries, 64);
        for p in sent {
            d.complete(&store, p, 500, false).unwrap();
        }
        assert_eq!(d.sweep(&store, 1, 999).unwrap().entries, 64);
        let sweep = d.sweep(&store, 1, 1000).unwrap();
        assert_eq!((sweep.purged, sweep.entries), (64, 0));
        let _in_flight = pending(verdict(&d, &store, &keys[64], 1, 1000));
    }

    #[test]
    fn retry_after_is_capped_by_the_gate_policy() {
        let d = Dedup::new(dedup(r#"{"windowMs": 600000}"#).policy().clone(), 1000, 30);
        let store = MemoryStore::default();
        let a = keyed(&d, &call("1"), ALICE);
        let _in_flight = pending(verdict(&d, &store, &a, 1, 0));
        assert_eq!(retry_after(&verdict(&d, &store, &a, 1, 1)), Some(30));
    }

    #[test]
    fn methods_and_scopes() {
        let d = dedup("{}");
        let with_key = |key| Client {
            ip: "192.0.2.9",
            key: Some(key),
        };
        let other_ip = |ip| Client { ip, key: None };
        // Not deduplicated by default: polled methods.
        let poll = r#"{"jsonrpc":"2.0","id":1,"method":"eth_blockNumber","params":[]}"#;
        assert_eq!(
            d.key(poll.as_bytes(), &name(&d, other_ip("192.0.2.1"))),
            Err(Skip::Method)
        );
        // Client scope: by key when sent, else by address.
        let body = call("1");
        assert_eq!(
            keyed(&d, &body, with_key("k1")).key,
            keyed(
                &d,
                &body,
                Client {
                    ip: "192.0.2.200",
                    key: Some("k1")
                }
            )
            .key
        );
        assert_ne!(
            keyed(&d, &body, with_key("k1")).key,
            keyed(&d, &body, with_key("k2")).key
        );
        assert_ne!(
            keyed(&d, &body, other_ip("192.0.2.1")).key,
            keyed(&d, &body, other_ip("192.0.2.2")).key
        );
        // eth_sendRawTransaction is global by default: the same raw
        // transaction from anyone is one request.
        let tx =
            r#"{"jsonrpc":"2.0","id":1,"method":"eth_sendRawTransaction","params":["0xf86b"]}"#;
        assert_eq!(
            keyed(&d, tx, other_ip("192.0.2.1")).key,
            keyed(&d, tx, with_key("k1")).key
        );
        // A batch: deduplicated only if every method is; global only if
        // every method is.
        let batch = format!("[{body},{tx}]");
        let k = keyed(&d, &batch, other_ip("192.0.2.1"));
        assert_ne!(k.key, keyed(&d, &batch, other_ip("192.0.2.2")).key);
        assert_eq!(
            d.key(
                format!("[{body},{poll}]").as_bytes(),
                &name(&d, other_ip("192.0.2.1"))
            ),
            Err(Skip::Method)
        );
        // Lists: exclude, and global scope for everything.
        let d = dedup(r#"{"exclude": ["eth_call"], "scope": "global"}"#);
        assert_eq!(
            d.key(body.as_bytes(), &name(&d, other_ip("192.0.2.1"))),
            Err(Skip::Method)
        );
        let logs = r#"{"method":"eth_getLogs","params":[{}]}"#;
        assert_eq!(
            keyed(&d, logs, other_ip("192.0.2.1")).key,
            keyed(&d, logs, other_ip("192.0.2.2")).key
        );
    }

    #[test]
    fn bad_sections_name_the_field() {
        for (section, field) in [
            (r#"{"windowMs": 0}"#, "dedup.windowMs"),
            (r#"{"maxBodyBytes": 2000000}"#, "dedup.maxBodyBytes"),
            (r#"{"maxEntries": 10}"#, "dedup.maxEntries"),
            (r#"{"scope": "planet"}"#, "dedup.scope"),
            (r#"{"apiKeyHeader": "X-Key"}"#, "dedup.apiKeyHeader"),
            (r#"{"methods": ["eth_call", ""]}"#, "dedup.methods[1]"),
            (
                r#"{"methods": ["eth_call"], "exclude": ["eth_call"]}"#,
                "dedup.methods",
            ),
            (r#"{"window": 5}"#, "dedup"),
        ] {
            let err = GatePolicy::parse(
                format!(r#"{{"maxInflight": 100, "dedup": {section}}}"#).as_bytes(),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(field), "{section}: {err}");
        }
    }
}
