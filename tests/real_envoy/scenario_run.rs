//! `stakegate scenario run` end to end: the shipped scenario files, run for
//! real (shortened), and what the run writes.

use serde_json::Value;
use stakegate_stack::paths;
use std::path::Path;

/// Runs `stakegate scenario run NAME --json` for `duration` into `out` and
/// returns the summary it printed.
fn scenario_run(name: &str, duration: &str, out: &Path) -> Value {
    let output = std::process::Command::new(paths::tool("stakegate").unwrap())
        .args(["scenario", "run", name, "--json", "--duration", duration])
        .arg("--out")
        .arg(out)
        .current_dir(paths::project_root())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    eprintln!("{stderr}");
    serde_json::from_slice(&output.stdout).unwrap()
}

fn client<'a>(summary: &'a Value, id: &str) -> &'a Value {
    summary["clients"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap()
}

#[test]
fn policies_swap_under_load_without_a_failed_request() {
    let out = tempfile::tempdir().unwrap();
    // Two of the scenario's swaps fall within 8 s (at 3 s and 6 s).
    let summary = scenario_run("hot-swap-under-load", "8s", out.path());
    assert_eq!(summary["mode"], "real");
    let swaps = summary["swaps"].as_array().unwrap();
    assert_eq!(swaps.len(), 2, "{swaps:?}");
    for swap in swaps {
        assert!(swap["error"].is_null(), "{swap}");
        assert!(swap["version"].as_u64().unwrap() >= 2, "{swap}");
    }
    let status = summary["status_counts"].as_object().unwrap();
    let answered = status["200"].as_u64().unwrap();
    let all: u64 = status.values().map(|n| n.as_u64().unwrap()).sum();
    assert!(answered >= 6000, "{status:?}");
    assert_eq!(answered, all, "every request answered 200: {status:?}");
    assert_eq!(summary["node"]["upstream"]["amplification"], 1.0);

    // What the run wrote beside the summary.
    let dir = out.path();
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    assert_eq!(written["status_counts"], summary["status_counts"]);
    let csv = std::fs::read_to_string(dir.join("timeline.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next(),
        Some("second,client,admitted,rejected,failed,tip_lag_ms,node_queue")
    );
    let admitted: u64 = lines
        .map(|line| line.split(',').nth(2).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(
        admitted, answered,
        "the timeline holds every admitted request"
    );
    for plot in ["admitted.png", "tip_lag.png", "shares.png"] {
        let bytes = std::fs::read(dir.join(plot)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{plot} is a PNG");
        assert!(bytes.len() > 5_000, "{plot} has something drawn");
    }
}

#[test]
fn a_client_150_ms_away_with_150_ms_requests_reaches_its_share() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("latency-fairness", "6s", out.path());
    let rate = |id: &str| client(&summary, id)["admitted_rps"].as_f64().unwrap();
    let (fast, slow) = (rate("fast"), rate("slow"));
    assert!(fast > 50.0, "the fast client was served: {fast}");
    assert!(slow / fast >= 0.9, "slow {slow} vs fast {fast} rps");
    // The relay's round trip shows in what the slow client saw: at least
    // 150 ms of path plus 150 ms of service.
    let p50 = client(&summary, "slow")["latency_ms"]["p50"]
        .as_f64()
        .unwrap();
    assert!(p50 >= 300.0, "slow p50 {p50} ms");
}

#[test]
fn the_whole_gateway_shares_by_stake_holds_the_tip_and_serves_internal_calls() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("gateway", "8s", out.path());
    let status = summary["status_counts"].as_object().unwrap();
    for (code, n) in status {
        assert!(
            ["200", "429", "503"].contains(&code.as_str()) || n == 0,
            "only admitted, throttled or shed: {status:?}"
        );
    }
    assert!(
        status["429"].as_u64().unwrap() > 0,
        "QoS throttled: {status:?}"
    );
    assert_eq!(summary["node"]["tip_lost"], false);
    // The gate's limit (8) and the internal calls, which hold no slot.
    assert!(summary["node"]["inflight_max"].as_u64().unwrap() <= 8 + 4);
    let internal = client(&summary, "internal")["status_counts"]
        .as_object()
        .unwrap();
    let sent: u64 = internal.values().map(|n| n.as_u64().unwrap()).sum();
    assert!(sent >= 150, "{internal:?}");
    assert_eq!(
        internal["200"], sent,
        "every internal call served: {internal:?}"
    );
    let admitted = |id: &str| client(&summary, id)["admitted_rps"].as_f64().unwrap();
    assert!(
        admitted("stake-40") > admitted("stake-20") && admitted("stake-20") > admitted("unstaked"),
        "shares follow stake: {}",
        summary["clients"]
    );
}

/// scenarios/fleet.toml whole: three gateway replicas (each its own Envoy
/// with the whole gateway) share 300 rps through real Redis and Webdis;
/// the 40-staker sends only to replica 1, the others to all three, and
/// Redis is stopped for 10 s mid-run.
#[test]
fn a_fleet_shares_one_capacity_by_stake_and_keeps_serving_without_redis() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("fleet", "26s", out.path());
    let fleet = &summary["fleet"];
    assert_eq!(fleet["replicas_seen_min"], 3, "{fleet}");
    let phase = |name: &str| -> &Value {
        fleet["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["phase"] == name)
            .unwrap_or_else(|| panic!("no {name} phase: {fleet}"))
    };
    let number = |v: &Value, field: &str| v[field].as_f64().unwrap();
    for name in ["fleet", "redis back"] {
        let p = phase(name);
        assert!(
            (number(p, "of_capacity") - 1.0).abs() <= 0.03,
            "{name}: the fleet admits its capacity once: {p}"
        );
        assert!(
            number(p, "max_share_error_pp") <= 2.0,
            "{name}: fleet-wide max-min shares: {p}"
        );
    }
    let away = phase("redis away");
    assert!(
        number(away, "of_capacity") <= 1.05,
        "without Redis, at most capacity + 5 %: {away}"
    );
    for p in fleet["phases"].as_array().unwrap() {
        assert_eq!(p["failed"], 0, "no request fails because of Redis: {p}");
    }
    let status = summary["status_counts"].as_object().unwrap();
    for (code, n) in status {
        assert!(
            ["200", "429"].contains(&code.as_str()) || n == 0,
            "only admitted or throttled: {status:?}"
        );
    }
    let outage = &fleet["redis_outages"][0];
    assert!(
        outage["all_on_fallback_after_s"].is_number(),
        "every replica fell back: {outage}"
    );
    // Measured: fleet shares back within about 0.2 s of Redis. The bound
    // leaves room for a busy machine; the figure is in the summary.
    assert!(
        number(outage, "fleet_shares_back_after_s") <= 5.0,
        "fleet shares came back: {outage}"
    );
}

/// scenarios/node-time-shares.toml and node-time-qos.toml, shortened: the
/// same four callers of methods from 0.2 ms to 40 ms through the whole
/// gateway, with QoS sharing calls, then node time (and the gate in
/// `nodeTime`). rpc-node says what each answer cost it, and the load
/// generator sums it per client.
#[test]
fn shares_of_node_time_follow_stake_where_shares_of_calls_do_not() {
    let out = tempfile::tempdir().unwrap();
    let costs = [
        ("light", 0.2),
        ("call", 5.0),
        ("logs", 20.0),
        ("proof", 40.0),
    ];
    let calls = scenario_run("node-time-shares", "6s", out.path());
    let mut node_shares = 0.0;
    for (id, cost_ms) in costs {
        let c = client(&calls, id);
        let ok = c["status_counts"]["200"].as_f64().unwrap();
        assert!(ok > 0.0, "{id}: {c}");
        // The node's own time: at least each call's cost (a sleep can only
        // overrun), never the time the client waited.
        let node_ms = c["node_ms"].as_f64().unwrap();
        assert!(
            node_ms >= ok * cost_ms * 0.999,
            "{id}: {node_ms} ms for {ok} calls"
        );
        node_shares += c["node_share"].as_f64().unwrap();
    }
    assert!((node_shares - 1.0).abs() < 1e-3, "{node_shares}");
    let share = |summary: &Value, id: &str| client(summary, id)["node_share"].as_f64().unwrap();
    assert!(share(&calls, "light") < share(&calls, "call"));
    assert!(share(&calls, "call") < share(&calls, "logs"));

    let node_time = scenario_run("node-time-qos", "6s", out.path());
    let error = |summary: &Value| summary["max_node_share_error_pp"].as_f64().unwrap();
    assert!(
        error(&node_time) < error(&calls) / 2.0,
        "node time {} pp from max-min, calls {} pp",
        error(&node_time),
        error(&calls)
    );
    assert!(
        share(&node_time, "call") > share(&calls, "call"),
        "eth_call's caller gets more of the node"
    );
    // The gate keeps a slot for cheap calls and lets heavy ones wait for
    // theirs: it never sheds the light caller.
    let light = client(&node_time, "light");
    assert_eq!(light["status_counts"]["503"], 0, "{light}");
}

/// scenarios/node-time-cost-change.toml, shortened: eth_call's cost goes
/// from 5 ms to 50 ms at 10 s; QoS learns it from the answers, and its
/// caller keeps its half of the node's time with a tenth of the calls.
#[test]
fn a_change_of_cost_is_learned_from_the_answers() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("node-time-cost-change", "14s", out.path());
    let timeline = client(&summary, "call")["timeline"].as_array().unwrap();
    let mean = |field: &str, seconds: std::ops::Range<usize>| {
        let n = seconds.len() as f64;
        seconds
            .map(|s| timeline[s][field].as_f64().unwrap_or(0.0))
            .sum::<f64>()
            / n
    };
    // What QoS measures includes Envoy's own time, a few ms on a busy
    // machine, which narrows the tenfold change in calls: the bounds leave
    // room for it. Charged the old 5 ms, the caller would keep its calls and
    // take ten times its node time.
    let (before, after) = (mean("ok", 3..9), mean("ok", 12..13));
    assert!(
        after * 3.0 < before,
        "calls per second {before} then {after}"
    );
    let (before, after) = (mean("node_ms", 3..9), mean("node_ms", 12..13));
    assert!(
        after > 0.4 * before && after < 2.5 * before,
        "node ms per second {before} then {after}"
    );
    let error = summary["max_node_share_error_pp"].as_f64().unwrap();
    assert!(error <= 10.0, "{error} pp");
}

/// scenarios/gpa-flood.toml, shortened: a getProgramAccounts flood beside
/// ordinary Solana callers with the same stake, through the whole gateway
/// sharing the node's time. The ordinary callers send less than their
/// share and get it once the run is under way: from its third second on,
/// nothing of theirs is refused. (The first moments, before a method's cost
/// is learned and the grants follow demand, may refuse a few: on a busy
/// machine up to 23 of the explorer's first 100; a figure, printed.) The
/// flood gets the rest; the node keeps up with its slots. Their latency,
/// with and without the gateway, is in scenarios/README.md (a figure, not a
/// check).
#[test]
fn a_get_program_accounts_flood_leaves_ordinary_callers_their_share() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("gpa-flood", "8s", out.path());
    for id in ["wallet", "trader", "explorer"] {
        let c = client(&summary, id);
        let seconds = c["timeline"].as_array().unwrap();
        let count = |from: usize, what: &str| -> u64 {
            seconds[from.min(seconds.len())..]
                .iter()
                .map(|s| s[what].as_u64().unwrap())
                .sum()
        };
        eprintln!(
            "{id}: refused {} in the first two seconds, {} after; statuses {}",
            count(0, "rejected") - count(2, "rejected"),
            count(2, "rejected"),
            c["status_counts"]
        );
        assert!(seconds.len() >= 6, "{id}: {c}");
        assert!(count(2, "ok") > 0, "{id}: {c}");
        assert_eq!(count(2, "rejected") + count(2, "failed"), 0, "{id}: {c}");
        for status in ["other", "timeout", "transport_error"] {
            assert_eq!(c["status_counts"][status], 0, "{id}: {c}");
        }
    }
    let indexer = client(&summary, "indexer");
    assert!(
        indexer["status_counts"]["429"].as_u64().unwrap() > 0,
        "{indexer}"
    );
    assert!(
        indexer["status_counts"]["200"].as_u64().unwrap() > 0,
        "{indexer}"
    );
    assert_eq!(summary["node"]["tip_lost"], false, "{}", summary["node"]);
}

/// scenarios/solana-stake-shares.toml, shortened: the seeds' stake shares
/// with a Solana wallet's calls to rpc-node's Solana flavour. Every call is
/// admitted or throttled (no 503, nothing failed), and what each client is
/// admitted follows its stake.
#[test]
fn stake_shares_hold_with_solana_traffic() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("solana-stake-shares", "6s", out.path());
    let status = summary["status_counts"].as_object().unwrap();
    for (code, n) in status {
        assert!(
            ["200", "429"].contains(&code.as_str()) || n == 0,
            "only admitted or throttled: {status:?}"
        );
    }
    let admitted = |id: &str| client(&summary, id)["admitted_rps"].as_f64().unwrap();
    let order = ["unstaked", "stake-10", "stake-20", "stake-30", "stake-40"];
    for pair in order.windows(2) {
        assert!(
            admitted(pair[0]) < admitted(pair[1]),
            "{} below {}: {}",
            pair[0],
            pair[1],
            summary["clients"]
        );
    }
}

/// scenarios/read-mix.toml, whole: explorers and an indexer replaying reads
/// of final blocks beside a wallet polling the head, through the gate with
/// its answer cache. Every request is answered, and at least half of them
/// never reach the node (the figure; the node counts what it saw).
#[test]
fn most_reads_of_final_history_never_reach_the_node() {
    let out = tempfile::tempdir().unwrap();
    let summary = scenario_run("read-mix", "30s", out.path());
    let answered = summary["status_counts"]["200"].as_u64().unwrap();
    let sent: u64 = summary["status_counts"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(answered, sent, "{}", summary["status_counts"]);
    let avoided = summary["node"]["calls_avoided"].as_f64().unwrap();
    assert!(
        avoided >= 0.5,
        "{avoided} of the calls avoided: {}",
        summary["node"]
    );
}
