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
    Dedup::new(policy.dedup.unwrap(), 1000)
}

fn call(params: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":7,"method":"eth_call","params":[{params}]}}"#)
}

fn name(dedup: &Dedup, mut client: Client) -> String {
    client_name(dedup.policy(), &mut client)
}

fn keyed(dedup: &Dedup, body: &str, client: Client) -> Keyed {
    dedup
        .key(body.as_bytes(), "", &name(dedup, client))
        .unwrap()
}

fn verdict(d: &Dedup, store: &MemoryStore, keyed: &Keyed, vm: u32, now: u64) -> Verdict {
    d.check(store, &keyed.key, vm, now, false).unwrap().verdict
}

fn lead(verdict: Verdict) -> Pending {
    match verdict {
        Verdict::Lead(p) => p,
        other => panic!("expected Lead, got {other:?}"),
    }
}

fn entry(d: &Dedup, store: &MemoryStore, keyed: &Keyed) -> Option<Entry> {
    let page = page_key(page_of(&keyed.key, d.policy().pages));
    let (page, _) = read::<Page>(store, &page).unwrap();
    page.entries.into_iter().find(|e| e.key == keyed.key)
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

const ANSWERED: Outcome = Outcome::Answered {
    keep: true,
    reuse: false,
};

#[test]
fn identical_requests_wait_for_the_leader_and_an_answer_is_shared_once() {
    let (d, store) = (dedup("{}"), MemoryStore::default());
    let a = keyed(&d, &call("1"), ALICE);
    let led = lead(verdict(&d, &store, &a, 1, 10_000));
    // Two more on VM 1 and one on VM 2 wait; each is counted.
    for vm in [1, 1, 2] {
        assert_eq!(verdict(&d, &store, &a, vm, 10_100), Verdict::Wait);
    }
    assert_eq!(entry(&d, &store, &a).unwrap().waiters, 4);
    // Another request, or the same from another client, is not identical.
    let bob = Client {
        ip: "192.0.2.2",
        key: None,
    };
    let _other = lead(verdict(
        &d,
        &store,
        &keyed(&d, &call("2"), ALICE),
        1,
        10_100,
    ));
    let _bobs = lead(verdict(&d, &store, &keyed(&d, &call("1"), bob), 1, 10_100));
    // The answer: VM 1 answers its three, VM 2's one needs waking.
    let (completed, _) = d.complete(&store, &led, ANSWERED, 3, 0, 12_000).unwrap();
    assert_eq!(
        completed,
        Completed::Share {
            remote: 1,
            keep: None
        }
    );
    // The entry is gone: the next identical request (a poll) is sent.
    assert_eq!(entry(&d, &store, &a), None);
    let _poll = lead(verdict(&d, &store, &a, 2, 12_001));
}

#[test]
fn a_kept_answer_with_no_free_slot_takes_the_oldest_ones() {
    // One page, so its four answer slots fill.
    let (d, store) = (
        dedup(r#"{"maxEntries": 64, "windowMs": 10000}"#),
        MemoryStore::default(),
    );
    assert_eq!(d.policy().pages, 1);
    let keys: Vec<Keyed> = (0..5)
        .map(|n| keyed(&d, &call(&n.to_string()), ALICE))
        .collect();
    for (n, k) in keys.iter().enumerate() {
        let at = n as u64 * 100;
        let led = lead(verdict(&d, &store, k, 1, at));
        // Its client gives up before the answer: it is kept for the retry.
        d.left(&store, &k.key).unwrap();
        let (completed, _) = d.complete(&store, &led, ANSWERED, 0, 0, at + 50).unwrap();
        let Completed::Share { keep: Some(_), .. } = completed else {
            panic!("answer {n} not kept: {completed:?}");
        };
    }
    // The first (the oldest) gave its slot to the fifth.
    assert_eq!(entry(&d, &store, &keys[0]), None);
    let _first_again = lead(verdict(&d, &store, &keys[0], 1, 1000));
    assert!(matches!(
        verdict(&d, &store, &keys[4], 1, 1000),
        Verdict::Take(_)
    ));
}

#[test]
fn past_max_waiters_a_request_is_refused_with_429() {
    let (d, store) = (dedup(r#"{"maxWaiters": 2}"#), MemoryStore::default());
    let a = keyed(&d, &call("1"), ALICE);
    let _led = lead(verdict(&d, &store, &a, 1, 0));
    assert_eq!(verdict(&d, &store, &a, 1, 1), Verdict::Wait);
    let Verdict::Refuse(refusal) = verdict(&d, &store, &a, 1, 2) else {
        panic!("expected a refusal")
    };
    assert_eq!((refusal.status, refusal.retry_after_s), (429, 1));
    let body = refusal.answering(call("1").as_bytes()).body;
    assert!(
        body.contains(r#""id":7"#) && body.contains("-32005"),
        "{body}"
    );
    // One leaves: there is room again.
    d.left(&store, &a.key).unwrap();
    assert_eq!(verdict(&d, &store, &a, 1, 3), Verdict::Wait);
}

#[test]
fn an_answer_a_client_gave_up_on_is_the_next_identical_requests_within_the_window() {
    let (d, store) = (dedup(r#"{"windowMs": 5000}"#), MemoryStore::default());
    let a = keyed(&d, &call("1"), ALICE);
    let led = lead(verdict(&d, &store, &a, 1, 0));
    assert_eq!(verdict(&d, &store, &a, 2, 10), Verdict::Wait);
    // Both clients give up (the leader's, then the waiter on VM 2).
    d.left(&store, &a.key).unwrap();
    d.left(&store, &a.key).unwrap();
    let (completed, _) = d.complete(&store, &led, ANSWERED, 0, 0, 2000).unwrap();
    let Completed::Share {
        remote: 0,
        keep: Some(slot),
    } = completed
    else {
        panic!("expected a kept answer, got {completed:?}")
    };
    let kept = Answer {
        key: a.key,
        status: 200,
        content_type: "application/json".into(),
        content_encoding: None,
        ids: a.ids.clone(),
        body: br#"{"jsonrpc":"2.0","id":7,"result":"0x1"}"#.to_vec(),
    };
    d.keep(&store, slot, &kept).unwrap();
    // The retry takes it, once.
    assert_eq!(verdict(&d, &store, &a, 2, 3000), Verdict::Take(slot));
    assert_eq!(d.take(&store, slot, &a.key).unwrap(), Some(kept));
    let _again = lead(verdict(&d, &store, &a, 2, 3001));
    // Not kept: a slot is free, but the answer is too large.
    let b = keyed(&d, &call("2"), ALICE);
    let led = lead(verdict(&d, &store, &b, 1, 0));
    d.left(&store, &b.key).unwrap();
    let not_kept = Outcome::Answered {
        keep: false,
        reuse: false,
    };
    let done = Completed::Share {
        remote: 0,
        keep: None,
    };
    assert_eq!(
        d.complete(&store, &led, not_kept, 0, 0, 10).unwrap().0,
        done
    );
    assert_eq!(entry(&d, &store, &b), None);
    // Kept, it expires with the window.
    let led = lead(verdict(&d, &store, &b, 1, 100));
    d.left(&store, &b.key).unwrap();
    let kept = d.complete(&store, &led, ANSWERED, 0, 0, 200).unwrap().0;
    assert!(
        matches!(kept, Completed::Share { keep: Some(_), .. }),
        "{kept:?}"
    );
    let _fresh = lead(verdict(&d, &store, &b, 1, 5200));
    // Given up by one client and got by another waiting (the answer
    // came as the first retry gave up, say), it is kept too.
    let c = keyed(&d, &call("3"), ALICE);
    let led = lead(verdict(&d, &store, &c, 1, 0));
    assert_eq!(verdict(&d, &store, &c, 1, 1), Verdict::Wait);
    d.left(&store, &c.key).unwrap();
    let kept = d.complete(&store, &led, ANSWERED, 1, 0, 300).unwrap().0;
    assert!(
        matches!(
            kept,
            Completed::Share {
                remote: 0,
                keep: Some(_)
            }
        ),
        "{kept:?}"
    );
    // Nobody gave up: an answer some client got is not kept.
    let e = keyed(&d, &call("4"), ALICE);
    let led = lead(verdict(&d, &store, &e, 1, 4000));
    let got = d.complete(&store, &led, ANSWERED, 1, 0, 4100).unwrap().0;
    assert_eq!(got, done);
}

/// Solana: a transaction or a block asked at `finalized` (or at no
/// commitment, Solana's default) cannot change; at `confirmed` or
/// `processed` it can. A sent transaction is shared while in flight and
/// never served again: a client that sends it again wants it sent.
#[test]
fn solana_answers_are_served_again_only_when_finalized() {
    let d = dedup("{}");
    let reuse = |method: &str, params: &str| {
        let body = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"{method}","params":{params}}}"#);
        keyed(&d, &body, ALICE).reuse
    };
    assert_eq!(reuse("getTransaction", r#"["5sig"]"#), Reuse::Always);
    assert_eq!(
        reuse(
            "getTransaction",
            r#"["5sig",{"commitment":"finalized","maxSupportedTransactionVersion":0}]"#
        ),
        Reuse::Always
    );
    assert_eq!(
        reuse("getTransaction", r#"["5sig",{"commitment":"confirmed"}]"#),
        Reuse::No
    );
    assert_eq!(
        reuse("getBlock", r#"[7,{"commitment":"processed"}]"#),
        Reuse::No
    );
    assert_eq!(reuse("getBlock", "[7]"), Reuse::Always);
    assert_eq!(reuse("getBalance", r#"["Vote111"]"#), Reuse::No);
    assert_eq!(reuse("sendTransaction", r#"["AQID"]"#), Reuse::No);
    // Coalesced while in flight, whoever sends it.
    let bob = || Client {
        ip: "192.0.2.2",
        key: None,
    };
    let send = r#"{"jsonrpc":"2.0","id":1,"method":"sendTransaction","params":["AQID"]}"#;
    assert_eq!(keyed(&d, send, ALICE).key, keyed(&d, send, bob()).key);
    let balance = r#"{"jsonrpc":"2.0","id":1,"method":"getBalance","params":["Vote111"]}"#;
    assert_ne!(keyed(&d, balance, ALICE).key, keyed(&d, balance, bob()).key);
}

#[test]
fn an_answer_that_cannot_change_serves_every_identical_request_within_the_window() {
    let (d, store) = (dedup(r#"{"windowMs": 5000}"#), MemoryStore::default());
    let receipt =
        r#"{"jsonrpc":"2.0","id":1,"method":"eth_getTransactionReceipt","params":["0xab"]}"#;
    let a = keyed(&d, receipt, ALICE);
    assert_eq!(a.reuse, Reuse::OnceFinal);
    assert_eq!(
        keyed(&d, &call("1"), ALICE).reuse,
        Reuse::No,
        "eth_call at latest"
    );
    let batch = format!("[{receipt}]");
    assert_eq!(keyed(&d, &batch, ALICE).reuse, Reuse::No, "a batch");
    let send = r#"{"jsonrpc":"2.0","id":1,"method":"eth_sendRawTransaction","params":["0x1"]}"#;
    assert_eq!(keyed(&d, send, ALICE).reuse, Reuse::Always);
    // Once final: a receipt in block 0x10 with block 0x20 final, and
    // not with 0x0f final, nor with none known.
    let answer = |body: &str| Answer {
        key: a.key,
        status: 200,
        content_type: "application/json".into(),
        content_encoding: None,
        ids: a.ids.clone(),
        body: body.as_bytes().to_vec(),
    };
    let mined = answer(r#"{"jsonrpc":"2.0","id":1,"result":{"blockNumber":"0x10"}}"#);
    assert!(Reuse::OnceFinal.allows(&mined, Some(0x20)));
    assert!(!Reuse::OnceFinal.allows(&mined, Some(0x0f)));
    assert!(!Reuse::OnceFinal.allows(&mined, None));
    let hash = answer(r#"{"jsonrpc":"2.0","id":1,"result":"0xabc"}"#);
    assert!(Reuse::Always.allows(&hash, None));
    assert!(
        !Reuse::OnceFinal.allows(&hash, Some(u64::MAX)),
        "names no block"
    );
    let led = lead(verdict(&d, &store, &a, 1, 0));
    let found = Outcome::Answered {
        keep: true,
        reuse: true,
    };
    let (completed, _) = d.complete(&store, &led, found, 1, 0, 100).unwrap();
    let Completed::Share {
        keep: Some(slot), ..
    } = completed
    else {
        panic!("expected it kept, got {completed:?}")
    };
    // Taken again and again, until the window ends.
    for now in [200, 3000, 5099] {
        assert_eq!(verdict(&d, &store, &a, 2, now), Verdict::Take(slot));
    }
    let _fresh = lead(verdict(&d, &store, &a, 2, 5100));
}

#[test]
fn a_failed_leader_hands_over_to_a_waiter() {
    let (d, store) = (dedup("{}"), MemoryStore::default());
    shards(&store, &[(1, 0), (2, 0)]);
    let a = keyed(&d, &call("1"), ALICE);
    let led = lead(verdict(&d, &store, &a, 1, 0));
    assert_eq!(verdict(&d, &store, &a, 1, 1), Verdict::Wait);
    assert_eq!(verdict(&d, &store, &a, 2, 2), Verdict::Wait);
    // A waiter on the leading VM leads at once.
    let (completed, _) = d
        .complete(&store, &led, Outcome::Failed, 1, 1, 100)
        .unwrap();
    let Completed::LeadHere(led) = completed else {
        panic!("expected LeadHere, got {completed:?}")
    };
    assert_eq!(entry(&d, &store, &a).unwrap().waiters, 2);
    // Its client goes, and it fails too: VM 2's waiter is left; the
    // entry is orphaned, and the first to check again leads.
    d.left(&store, &a.key).unwrap();
    let (completed, _) = d
        .complete(&store, &led, Outcome::Failed, 0, 0, 200)
        .unwrap();
    assert_eq!(completed, Completed::Orphaned);
    assert_eq!(entry(&d, &store, &a).unwrap().state, State::Orphaned);
    let checked = d.check(&store, &a.key, 2, 300, true).unwrap();
    let led = lead(checked.verdict);
    assert_eq!(entry(&d, &store, &a).unwrap().waiters, 1);
    // With nobody left, a failure removes the entry.
    d.left(&store, &a.key).unwrap();
    assert_eq!(
        d.complete(&store, &led, Outcome::Failed, 0, 0, 400)
            .unwrap()
            .0,
        Completed::Done
    );
    assert_eq!(entry(&d, &store, &a), None);
}

#[test]
fn an_orphan_nobody_comes_back_for_goes() {
    let (d, store) = (dedup(r#"{"maxWaitMs": 1000}"#), MemoryStore::default());
    let a = keyed(&d, &call("1"), ALICE);
    let led = lead(verdict(&d, &store, &a, 1, 0));
    assert_eq!(verdict(&d, &store, &a, 2, 1), Verdict::Wait);
    // The leader's client gets the failure; VM 2's waiter is left.
    let (completed, _) = d.complete(&store, &led, Outcome::Failed, 1, 0, 10).unwrap();
    assert_eq!(completed, Completed::Orphaned);
    // Its last waiter leaves: the entry goes.
    d.left(&store, &a.key).unwrap();
    assert_eq!(entry(&d, &store, &a), None);
    // Or its waiters vanish: it expires after maxWaitMs.
    let led = lead(verdict(&d, &store, &a, 1, 2000));
    assert_eq!(verdict(&d, &store, &a, 2, 2001), Verdict::Wait);
    d.complete(&store, &led, Outcome::Failed, 1, 0, 2010)
        .unwrap();
    assert_eq!(d.sweep(&store, 1, 3009).unwrap().entries, 1);
    assert_eq!(d.sweep(&store, 1, 3010).unwrap().purged, 1);
}

#[test]
fn a_request_led_by_a_vanished_vm_is_led_again_after_the_window() {
    let (d, store) = (dedup(r#"{"windowMs": 5000}"#), MemoryStore::default());
    let a = keyed(&d, &call("1"), ALICE);
    // VM 1 leads, then vanishes: its last heartbeat is at 0.
    shards(&store, &[(1, 0), (2, 4900)]);
    let _lost = lead(verdict(&d, &store, &a, 1, 0));
    assert_eq!(verdict(&d, &store, &a, 2, 4999), Verdict::Wait);
    // The waiter, checking again on the heartbeat, leads.
    let checked = d.check(&store, &a.key, 2, 5000, true).unwrap();
    let _led = lead(checked.verdict);
    assert_eq!(entry(&d, &store, &a).unwrap().waiters, 2);
    // A slow leader that is alive keeps its waiters however long.
    let b = keyed(&d, &call("2"), ALICE);
    let _slow = lead(verdict(&d, &store, &b, 2, 0));
    shards(&store, &[(1, 0), (2, 60_000)]);
    assert_eq!(verdict(&d, &store, &b, 1, 60_000), Verdict::Wait);
    assert_eq!(d.sweep(&store, 1, 60_000).unwrap().entries, 2);
}

#[test]
fn a_full_page_lets_requests_pass_and_sweeps_empty_it() {
    let (d, store) = (
        dedup(r#"{"windowMs": 1000, "maxEntries": 64}"#),
        MemoryStore::default(),
    );
    assert_eq!(d.policy().max_entries(), 64);
    let keys: Vec<Keyed> = (0..65)
        .map(|i| keyed(&d, &call(&i.to_string()), ALICE))
        .collect();
    let led: Vec<Pending> = keys[..64]
        .iter()
        .map(|k| lead(verdict(&d, &store, k, 1, 0)))
        .collect();
    assert_eq!(verdict(&d, &store, &keys[64], 1, 10), Verdict::TableFull);
    // Still coalesced while the table is full.
    assert_eq!(verdict(&d, &store, &keys[0], 1, 10), Verdict::Wait);
    for p in &led {
        d.complete(&store, p, ANSWERED, 1, 0, 500).unwrap();
    }
    assert_eq!(d.sweep(&store, 1, 600).unwrap().entries, 0);
    let _led = lead(verdict(&d, &store, &keys[64], 1, 1000));
}

#[test]
fn repeated_ids_in_a_batch_are_not_coalesced() {
    let d = dedup("{}");
    let batch = format!("[{},{}]", call("1"), call("2"));
    assert_eq!(d.key(batch.as_bytes(), "", "c"), Err(Skip::RepeatedIds));
    let batch = batch.replacen(r#""id":7"#, r#""id":8"#, 1);
    let keyed = d.key(batch.as_bytes(), "", "c").unwrap();
    assert_eq!(keyed.ids, vec![Some(b"8".to_vec()), Some(b"7".to_vec())]);
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
        d.key(poll.as_bytes(), "", &name(&d, other_ip("192.0.2.1"))),
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
    let tx = r#"{"jsonrpc":"2.0","id":1,"method":"eth_sendRawTransaction","params":["0xf86b"]}"#;
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
            format!("[{body}, {poll}]").as_bytes(),
            "",
            &name(&d, other_ip("192.0.2.1"))
        ),
        Err(Skip::Method)
    );
    // Lists: exclude, and global scope for everything.
    let d = dedup(r#"{"exclude": ["eth_call"], "scope": "global"}"#);
    assert_eq!(
        d.key(body.as_bytes(), "", &name(&d, other_ip("192.0.2.1"))),
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
        (r#"{"maxWaitMs": 0}"#, "dedup.maxWaitMs"),
        (r#"{"maxWaiters": 0}"#, "dedup.maxWaiters"),
        (r#"{"maxAnswerBytes": 5000000}"#, "dedup.maxAnswerBytes"),
        (r#"{"upstream": {"cluster": ""}}"#, "dedup.upstream.cluster"),
        (
            r#"{"upstream": {"timeoutMs": 0}}"#,
            "dedup.upstream.timeoutMs",
        ),
        (r#"{"upstream": {"host": "x"}}"#, "dedup"),
    ] {
        let err =
            GatePolicy::parse(format!(r#"{{"maxInflight": 100, "dedup": {section}}}"#).as_bytes())
                .unwrap_err()
                .to_string();
        assert!(err.contains(field), "{section}: {err}");
    }
}
