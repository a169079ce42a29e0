use super::policy::CachePolicy;
use super::*;
use serde_json::{json, Value};

fn policy(max_bytes: u64, max_entries: u64) -> CachePolicy {
    CachePolicy {
        max_bytes,
        max_entries,
        max_answer_bytes: 4096,
        latest: false,
    }
}

fn request(id: Value, method: &str, params: Value) -> Vec<u8> {
    json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        .to_string()
        .into_bytes()
}

/// The node's answer to `body`, with the id the node wrote.
fn answer(node_id: &str, result: Value) -> Answer {
    Answer {
        key: [0; 16],
        status: 200,
        content_type: "application/json".into(),
        content_encoding: None,
        ids: vec![Some(node_id.as_bytes().to_vec())],
        body: format!(r#"{{"jsonrpc":"2.0","id":{node_id},"result":{result}}}"#).into_bytes(),
    }
}

/// The miss whose answer may be kept: `body`'s second.
fn miss(cache: &mut Cache, body: &[u8]) -> Miss {
    miss_worth(cache, body, 1)
}

fn miss_worth(cache: &mut Cache, body: &[u8], worth: u64) -> Miss {
    assert_eq!(cache.lookup(body, "", |_| worth), Lookup::First);
    match cache.lookup(body, "", |_| worth) {
        Lookup::Miss(miss) => miss,
        other => panic!("expected a miss, got {other:?}"),
    }
}

#[test]
fn a_final_answer_is_served_again_with_each_request_s_own_id() {
    let mut cache = Cache::new(policy(1 << 20, 100));
    let body = request(json!(1), "eth_getBlockByNumber", json!(["0x10", false]));
    let m = miss(&mut cache, &body);
    assert_eq!(m.lifetime, Lifetime::AtBlock(16));
    let block = json!({"number": "0x10", "hash": "0xab"});
    cache
        .keep(m, &answer("1", block.clone()), Some(20))
        .unwrap();
    // The same call with another id (the bytes around it the same).
    let again = request(json!("x7"), "eth_getBlockByNumber", json!(["0x10", false]));
    let Lookup::Hit(kept, ids) = cache.lookup(&again, "", |_| 1) else {
        panic!("a hit");
    };
    let served: Value = serde_json::from_slice(&kept.body_for(&ids)).unwrap();
    assert_eq!(served["id"], "x7");
    assert_eq!(served["result"], block);
    assert_eq!(cache.size().0, 1);
    // Spelled otherwise (spacing, member order), it is another key.
    let spelled = br#"{ "params":["0x10",false], "method":"eth_getBlockByNumber", "id":"x7", "jsonrpc":"2.0" }"#;
    assert_eq!(cache.lookup(spelled, "", |_| 1), Lookup::First);
}

#[test]
fn answers_that_could_change_are_never_kept() {
    let mut cache = Cache::new(policy(1 << 20, 100));
    let at = |n: &str| request(json!(1), "eth_getBalance", json!(["0xaa", n]));
    // Above the finalized block, or with none known.
    let m = miss(&mut cache, &at("0x30"));
    assert_eq!(
        cache.keep(m.clone(), &answer("1", json!("0x1")), Some(20)),
        Err(Unkept::NotFinal)
    );
    assert_eq!(
        cache.keep(m, &answer("1", json!("0x1")), None),
        Err(Unkept::NotFinal)
    );
    // Not found: null, an error, a failure, an encoded body.
    let receipt = request(json!(1), "eth_getTransactionReceipt", json!(["0xab"]));
    let m = miss(&mut cache, &receipt);
    assert_eq!(
        cache.keep(m.clone(), &answer("1", Value::Null), Some(20)),
        Err(Unkept::NotFound)
    );
    let mut error = answer("1", json!(1));
    error.body = br#"{"jsonrpc":"2.0","id":1,"error":{"code":-32000,"message":"x"}}"#.to_vec();
    assert_eq!(
        cache.keep(m.clone(), &error, Some(20)),
        Err(Unkept::NotFound)
    );
    let mut failed = answer("1", json!({"blockNumber": "0x1"}));
    failed.status = 503;
    assert_eq!(
        cache.keep(m.clone(), &failed, Some(20)),
        Err(Unkept::NotFound)
    );
    let mut encoded = answer("1", json!({"blockNumber": "0x1"}));
    encoded.content_encoding = Some("gzip".into());
    assert_eq!(
        cache.keep(m.clone(), &encoded, Some(20)),
        Err(Unkept::NotFound)
    );
    // A receipt in a block not final yet, then one in a final block.
    let pending = answer("1", json!({"blockNumber": "0x15", "status": "0x1"}));
    assert_eq!(
        cache.keep(m.clone(), &pending, Some(20)),
        Err(Unkept::NotFinal)
    );
    let settled = answer("1", json!({"blockNumber": "0x14", "status": "0x1"}));
    assert_eq!(cache.keep(m, &settled, Some(20)), Ok(0));
    // Moving tags, batches and notifications are not looked up at all.
    for body in [
        at("latest"),
        br#"[{"jsonrpc":"2.0","id":1,"method":"eth_chainId"}]"#.to_vec(),
        br#"{"jsonrpc":"2.0","method":"eth_chainId"}"#.to_vec(),
    ] {
        assert_eq!(cache.lookup(&body, "", |_| 1), Lookup::Uncacheable);
    }
    let too_large = answer("1", json!("x".repeat(5000)));
    let m = miss(&mut cache, &request(json!(1), "eth_chainId", json!([])));
    assert_eq!(cache.keep(m, &too_large, None), Err(Unkept::TooLarge));
}

#[test]
fn a_full_cache_drops_the_answer_worth_least_and_stays_within_its_bounds() {
    let block = |n: u64| {
        request(
            json!(1),
            "eth_getBlockByNumber",
            json!([format!("0x{n:x}"), false]),
        )
    };
    let one = answer("1", json!({"number": "0x1"}));
    let per_entry = one.body.len() as u64 + one.content_type.len() as u64 + ENTRY_OVERHEAD;
    let mut cache = Cache::new(policy(per_entry * 3, 100));
    let keep = |cache: &mut Cache, n: u64, worth: u64| {
        let m = miss_worth(cache, &block(n), worth);
        cache.keep(m, &one, Some(u64::MAX)).unwrap()
    };
    assert_eq!(keep(&mut cache, 1, 100), 0);
    assert_eq!(keep(&mut cache, 2, 1), 0);
    assert_eq!(keep(&mut cache, 3, 100), 0);
    // A fourth drops the cheap one, though it is not the oldest.
    assert_eq!(keep(&mut cache, 4, 100), 1);
    assert!(!matches!(
        cache.lookup(&block(2), "", |_| 1),
        Lookup::Hit(..)
    ));
    assert!(matches!(
        cache.lookup(&block(1), "", |_| 1),
        Lookup::Hit(..)
    ));
    // Among equals, the least recently served goes: 1 was just served.
    assert_eq!(keep(&mut cache, 5, 100), 1);
    assert!(!matches!(
        cache.lookup(&block(3), "", |_| 1),
        Lookup::Hit(..)
    ));
    assert!(matches!(
        cache.lookup(&block(1), "", |_| 1),
        Lookup::Hit(..)
    ));
    // Many distinct keys: never past the bounds.
    let mut cache = Cache::new(policy(64 * 1024, 200));
    for n in 0..100_000 {
        keep(&mut cache, n, 1 + n % 7);
        let (entries, bytes) = cache.size();
        assert!(
            entries <= 200 && bytes <= 64 * 1024,
            "{entries} entries, {bytes} bytes"
        );
    }
    let (entries, bytes) = cache.size();
    assert_eq!(entries, 200.min(64 * 1024 / per_entry));
    assert_eq!(bytes, entries * per_entry);
}

/// Looks requests up as the gate does: only those `looks_up` lets through.
/// Returns how many were looked up.
fn pass(cache: &mut Cache, bodies: impl Iterator<Item = Vec<u8>>) -> u32 {
    let mut looked = 0;
    for body in bodies {
        if cache.looks_up() {
            looked += 1;
            cache.lookup(&body, "", |_| 1);
        }
    }
    looked
}

fn call_at(n: u64) -> Vec<u8> {
    request(
        json!(n),
        "eth_getBalance",
        json!(["0xaa", format!("{n:#x}")]),
    )
}

#[test]
fn with_no_key_repeating_it_stands_by_and_a_sampled_repeat_engages_it() {
    let mut cache = Cache::new(policy(1 << 20, 100_000));
    // A window of unique keys: every one looked up, then it stands by.
    let unique = WINDOW as u64;
    assert_eq!(pass(&mut cache, (0..unique).map(call_at)), WINDOW);
    assert!(cache.standing_by());
    // Standing by, one request in SAMPLE_EVERY is looked up.
    let looked = pass(&mut cache, (unique..unique + 1600).map(call_at));
    assert_eq!(looked, 1600 / SAMPLE_EVERY);
    assert!(cache.standing_by());
    // The same call over and over: a sample repeats a key, and from then
    // on every request is looked up.
    let same = std::iter::repeat_with(|| call_at(7));
    let looked = pass(&mut cache, same.take(SAMPLE_EVERY as usize));
    assert_eq!(looked, 1);
    assert!(
        !cache.standing_by(),
        "the sample repeated a key seen before"
    );
    // A window where one lookup in REPEATS_AT_LEAST repeats a key keeps it
    // engaged; one with fewer does not.
    let window = |repeats: u64, from: u64| {
        (0..WINDOW as u64).map(move |i| {
            if i < repeats {
                call_at(7)
            } else {
                call_at(from + i)
            }
        })
    };
    assert_eq!(
        pass(
            &mut cache,
            window((WINDOW / REPEATS_AT_LEAST).into(), 1_000_000)
        ),
        WINDOW
    );
    assert!(!cache.standing_by());
    let fewer = (WINDOW / REPEATS_AT_LEAST - 1).into();
    assert_eq!(pass(&mut cache, window(fewer, 2_000_000)), WINDOW);
    assert!(cache.standing_by(), "{fewer} repeats in a window");
}

/// The policy docs give the standby's constants as the code has them.
#[test]
fn the_policy_docs_say_when_the_cache_stands_by_as_the_code_does() {
    let page = include_str!("../../../../policies/admission-gate.md");
    let text = page.split_whitespace().collect::<Vec<_>>().join(" ");
    for said in [
        format!("judges its last {WINDOW} lookups"),
        format!("fewer than one in {REPEATS_AT_LEAST} repeating a key"),
        format!("but one in {SAMPLE_EVERY}, which is looked up"),
    ] {
        assert!(text.contains(&said), "policies/admission-gate.md: {said:?}");
    }
}

#[test]
fn with_latest_a_read_at_latest_is_read_at_the_head_and_its_pinned_key_is_its_own() {
    let mut cache = Cache::new(CachePolicy {
        latest: true,
        ..policy(1 << 20, 100)
    });
    let at_latest = request(json!(1), "eth_getBalance", json!(["0xaa", "latest"]));
    let Lookup::AtHead(rules::AtHead::State(at), ids) = cache.lookup(&at_latest, "", |_| 1) else {
        panic!("read at the head");
    };
    assert_eq!(ids, [Some(b"1".to_vec())]);
    let hash = format!("0x{}", "ab".repeat(32));
    let pinned = rules::pinned(&at_latest, &at, &hash);
    assert_eq!(cache.lookup_pinned(&pinned, "", |_| 1), Lookup::First);
    let Lookup::Miss(miss) = cache.lookup_pinned(&pinned, "", |_| 1) else {
        panic!("its second miss");
    };
    assert_eq!(miss.lifetime, Lifetime::Pinned);
    cache.keep(miss, &answer("1", json!("0x2a")), None).unwrap();
    assert!(matches!(
        cache.lookup_pinned(&pinned, "", |_| 1),
        Lookup::Hit(..)
    ));
    // A client asking at that hash itself is not given it: the node says
    // whether it still knows the block.
    assert_eq!(cache.lookup(&pinned, "", |_| 1), Lookup::Uncacheable);
    // Without `latest`, a read at `latest` is not looked at.
    let mut off = Cache::new(policy(1 << 20, 100));
    assert_eq!(off.lookup(&at_latest, "", |_| 1), Lookup::Uncacheable);
}
