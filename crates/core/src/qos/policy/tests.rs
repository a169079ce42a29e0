use super::*;
use crate::cost::{method_key, Unit};

const KEY_HASH: &str = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";

fn parse(json: &str) -> Result<QosPolicy, String> {
    QosPolicy::parse(json.as_bytes()).map_err(|e| e.to_string())
}

#[test]
fn minimal_policy_takes_the_defaults() {
    let p = parse(r#"{"capacityRps": 1000}"#).unwrap();
    assert_eq!(p.mode, Mode::Proactive);
    assert_eq!(p.throttle_threshold, 0.95);
    assert_eq!(p.refill_interval_ms, 20);
    assert_eq!(p.unstaked_stake, 1000);
    assert_eq!(p.api_key_header, "x-api-key");
    assert_eq!(p.tiers, ["unstaked", "staked"]);
    assert_eq!(p.reactive.min_capacity_rps, 50.0);
}

#[test]
fn stakes_by_key_hash_and_peer_with_tiers() {
    let p = parse(&format!(
        r#"{{"capacityRps": 100, "stakes": [
            {{"apiKeySha256": "{}", "name": "acme", "stake": 40, "tier": "gold"}},
            {{"peer": "spiffe://x/y", "name": "y", "stake": 10}}]}}"#,
        KEY_HASH.to_uppercase()
    ))
    .unwrap();
    assert_eq!(p.by_api_key[KEY_HASH].tier, 2);
    assert_eq!(p.tiers[2], "gold");
    assert_eq!(p.by_peer["spiffe://x/y"].tier, TIER_STAKED);
}

#[test]
fn the_capacity_field_names_the_unit() {
    let calls = parse(r#"{"capacityRps": 1000}"#).unwrap();
    assert_eq!((calls.costs.unit, calls.costs.default), (Unit::Calls, 1.0));
    let node = parse(r#"{"capacityNodeMs": 7600, "costs": {"eth_getLogs": 20}}"#).unwrap();
    assert_eq!(node.costs.unit, Unit::NodeTime);
    assert_eq!(node.capacity_rps, 7600.0);
    assert_eq!(node.costs.default, DEFAULT_NODE_MS);
    assert_eq!(node.identify_above, 0.5, "counted far below, by time");
    assert_eq!(node.costs.table[&method_key("eth_getLogs")], 20.0);
    let large = parse(r#"{"capacityNodeMs": 100000000}"#).unwrap();
    assert_eq!(
        large.reactive.max_capacity_rps, 400_000_000.0,
        "the unit's bound"
    );
    let cost = parse(r#"{"capacityCost": 5000, "costs": {"a": 10, "b": 26}}"#).unwrap();
    assert_eq!((cost.costs.unit, cost.costs.default), (Unit::Cost, 26.0));
    assert_eq!(cost.identify_above, 0.0, "every request is identified");
}

/// Each case's error contains its text.
fn refused(cases: &[(&str, &str)]) {
    for (json, expected) in cases {
        let e = parse(json).unwrap_err();
        assert!(e.contains(expected), "{json}: {e}");
    }
}

#[test]
fn a_bad_capacity_or_cost_table_is_refused_with_the_field_and_the_reason() {
    refused(&[
        (r#"{}"#, "capacityRps: missing: give the capacity"),
        (
            r#"{"capacityRps": 100, "capacityNodeMs": 8000}"#,
            "capacityNodeMs: give one capacity: capacityRps is given",
        ),
        (
            r#"{"capacityNodeMs": 0.5}"#,
            "capacityNodeMs: must be between 1 and 1000000000; got 0.5",
        ),
        (
            r#"{"capacityRps": 100, "costs": {"eth_call": 5}}"#,
            "costs: capacityRps shares calls, each costing 1",
        ),
        (
            r#"{"capacityRps": 100, "defaultCost": 5}"#,
            "defaultCost: capacityRps shares calls",
        ),
        (
            r#"{"capacityNodeMs": 8000, "costs": {"eth_call": -5}}"#,
            "costs.eth_call: must be between 0.001 and 1000000; got -5",
        ),
        (
            r#"{"capacityCost": 8000, "costs": {"eth_call": "5"}}"#,
            "costs.eth_call: invalid type",
        ),
        (
            r#"{"capacityCost": 8000, "costs": {"": 5}}"#,
            "costs.: a method name is 1 to 128 bytes",
        ),
        (
            r#"{"capacityNodeMs": 8000, "defaultCost": 0}"#,
            "defaultCost: must be between 0.001 and 1000000; got 0",
        ),
        (
            r#"{"capacityCost": 8000, "identifyAbove": 0.5}"#,
            "identifyAbove: a call's cost is known only from its method",
        ),
    ]);
}

#[test]
fn errors_name_the_field_and_the_reason() {
    let cases = [
        (
            r#"{"capacityRps": 0}"#,
            "capacityRps: must be between 1 and 10000000; got 0",
        ),
        (
            r#"{"capacityRps": 1e-300}"#,
            "capacityRps: must be between 1 and 10000000; got 1e-300",
        ),
        (
            r#"{"capacityRps": 1e19}"#,
            "capacityRps: must be between 1 and 10000000; got 1e19",
        ),
        (
            r#"{"capacityRps": 1, "throttleThreshold": 1.5}"#,
            "throttleThreshold: must be between 0.01 and 1; got 1.5",
        ),
        (r#"{"capacityRps": 1, "burst": 2}"#, "unknown field `burst`"),
        (
            r#"{"capacityRps": 1, "mode": "magic"}"#,
            "mode: unknown variant `magic`",
        ),
        (
            r#"{"capacityRps": 1, "stakes": [{"apiKeySha256": "secret", "name": "a", "stake": 1}]}"#,
            "stakes[0].apiKeySha256: must be 64 hex digits",
        ),
        (
            r#"{"capacityRps": 1, "stakes": [{"name": "a", "stake": 1}]}"#,
            "stakes[0]: needs exactly one of apiKeySha256 and peer",
        ),
        (
            r#"{"capacityRps": 1, "identity": {"trustedProxies": ["10.0.0.0/40"]}}"#,
            "identity.trustedProxies[0]:",
        ),
        (
            r#"{"capacityRps": 1, "identity": {"order": ["address", "address"]}}"#,
            "identity.order[1]: Address is listed twice",
        ),
        (
            r#"{"capacityRps": 1, "maxIdentities": 0}"#,
            "maxIdentities: must be between 1 and 1000000; got 0",
        ),
        (
            r#"{"capacityRps": 100, "maxIdentities": 1000000, "refillIntervalMs": 5}"#,
            "maxIdentities: 1000000 identities refilled every 5 ms is 200000000 identity visits a second, over the budget of 1280000",
        ),
        (
            r#"{"capacityRps": 1, "reactive": {"decrease": 1.2}}"#,
            "reactive.decrease: must be between 0.01 and 0.99; got 1.2",
        ),
        (
            r#"{"capacityRps": 1, "identity": {"apiKeyHeader": "x key"}}"#,
            "identity.apiKeyHeader: must be a lower-case HTTP header name",
        ),
        (
            r#"[1000]"#,
            ".: a policy is a JSON object; got an array",
        ),
        (
            r#"{"capacityRps": 1, "concurrency": [4, 0.5, 0.2]}"#,
            "concurrency: is not a list",
        ),
        (
            r#"{"capacityRps": 1, "stakes": [{"peer": "p", "name": "a", "stake": 1e30}]}"#,
            "stakes[0].stake: invalid type",
        ),
        (
            r#"{"capacityRps": 1, "stakes": [{"peer": "p", "name": "a", "stake": 2000000000000000000}]}"#,
            "stakes[0].stake: must be between 0 and 1000000000000000000",
        ),
    ];
    refused(&cases);
}
