//! `stakegate sim SCENARIO.toml`: the scenario's clients through the
//! compiled filters in the offline host, against a virtual node, in virtual
//! time.
//!
//! The virtual node is rpc-node in miniature ([`node::VirtualNode`]). Each
//! client's requests arrive on a
//! fixed schedule; its `latency` is added to what it observes, and after its
//! `timeout` it gives up (a waiting request leaves the node's queue, one
//! being served is finished for nobody). The filters
//! form a chain, as in Envoy: a request goes upstream only if every filter
//! lets it through, and a later filter's local reply ends it for the
//! earlier ones.

mod node;
mod world;

use crate::scenario::Scenario;
use crate::summary::{ShadowCheck, ShadowIdentity, Summary};
use crate::usage::{self, Row};
use stakegate_core::baseline::Mechanism;
use std::collections::BTreeMap;
use std::path::PathBuf;
use world::World;

#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// The scenario file.
    pub scenario: PathBuf,
    /// Print the JSON summary instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also show what another mechanism would have admitted per client from
    /// the same traffic: agave-ema-legacy or agave-threshold (docs/background.md part 1).
    #[arg(long = "baseline", value_parser = ["agave-ema-legacy", "agave-threshold"])]
    pub baselines: Vec<String>,
    /// Runs the same traffic with no filters in the way: what the node
    /// faces unprotected.
    #[arg(long)]
    pub no_filters: bool,
}

/// What a simulated run says when the gate's answer cache is on: the
/// virtual node answers no bodies and no finality poll, so nothing is
/// kept, and the upstream counts are the node's without the cache.
pub const CACHE_NOT_MODELLED: &str = "not modelled in the simulator (the virtual node answers no bodies and no finality poll, so nothing is kept: the upstream counts are the node's without the cache); `stakegate scenario run` measures it";

/// Runs a scenario and returns its summary, with what each of `baselines`
/// would have admitted from the same arrivals.
pub fn simulate(scenario: &Scenario, baselines: &[Mechanism]) -> anyhow::Result<Summary> {
    if scenario.replicas > 1 {
        anyhow::bail!(
            "gateway.replicas: the simulator runs one gateway; run a fleet for real (`stakegate scenario run`); the fleet rule itself is tested in virtual time in crates/core"
        );
    }
    let mut world = World::new(scenario, baselines)?;
    world.run()?;
    let mut summary = world.summary(baselines);
    if let Some(node) = summary.node.as_mut().filter(|_| scenario.caches()) {
        node.cache = Some(CACHE_NOT_MODELLED);
    }
    if let Some(promoted) = scenario.promoted()? {
        let mut enforcing = World::new(&promoted, &[])?;
        enforcing.run()?;
        let enforced = enforcing.summary(&[]).filter_metrics;
        summary.shadow = Some(shadow_check(&summary.filter_metrics, &enforced));
    }
    Ok(summary)
}

/// Per identity: the live stake QoS's refusals and the shadow candidate's
/// in one run (`shadowed`), against the candidate's when it enforced
/// (`enforced`), from their usage ledgers.
fn shadow_check(shadowed: &BTreeMap<String, i64>, enforced: &BTreeMap<String, i64>) -> ShadowCheck {
    let ledger = |metrics: &BTreeMap<String, i64>, prefix: &str| {
        let prefix = prefix.trim_start_matches("wasmcustom.");
        let stats = metrics.iter().map(|(n, v)| (n.as_str(), *v as u64));
        usage::rows(prefix, stats)
            .into_iter()
            .map(|row| (row.identity.clone(), row))
            .collect::<BTreeMap<String, Row>>()
    };
    let live = ledger(shadowed, usage::LIVE);
    let candidate = ledger(shadowed, usage::SHADOW);
    let enforcing = ledger(enforced, usage::LIVE);
    let empty = Row::default();
    let identities = live
        .values()
        .map(|row| {
            let id = row.identity.as_str();
            ShadowIdentity::new(
                row.identity.clone(),
                row.requests,
                row.refused_by_qos(),
                candidate.get(id).unwrap_or(&empty).refused_total(),
                enforcing.get(id).unwrap_or(&empty).refused_by_qos(),
            )
        })
        .collect();
    ShadowCheck::new(identities)
}

pub fn table(scenario: &Scenario, summary: &Summary) -> String {
    let mut out = format!("{}\n", scenario.description);
    out += &format!(
        "{} ({}): {:.0} rps offered, {:.0} rps admitted, capacity {:.0} rps over {:.0} s\n",
        summary.scenario,
        summary.mode,
        summary.offered_rps,
        summary.admitted_rps,
        summary.capacity_rps,
        summary.duration_s
    );
    out += &format!(
        "{:<14} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "client",
        "stake",
        "offered",
        "admitted",
        "rejected",
        "adm %",
        "stake %",
        "p50 ms",
        "p99 ms"
    );
    for c in &summary.clients {
        let rejected = c.status_counts.get("503").copied().unwrap_or(0)
            + c.status_counts.get("429").copied().unwrap_or(0);
        out += &format!(
            "{:<14} {:>8} {:>10.1} {:>10.1} {:>9} {:>9.1} {:>9.1} {:>9.2} {:>9.2}\n",
            c.id,
            c.stake,
            c.offered_rps,
            c.admitted_rps,
            rejected,
            c.admitted_share * 100.0,
            c.stake_share * 100.0,
            c.latency_ms.p50,
            c.latency_ms.p99,
        );
    }
    if let Some(node) = &summary.node {
        out += &format!(
            "node: tip lag max {:.0} ms, tip lost {}, queue max {}, blocks {}\n",
            node.tip_lag_max_ms, node.tip_lost, node.queue_max, node.blocks_executed
        );
        if let Some(up) = &node.upstream {
            out += &format!(
                "upstream: {} requests, {} unique, amplification {:.3}\n",
                up.requests, up.unique_requests, up.amplification
            );
        }
        if let Some(cache) = node.cache {
            out += &format!("answer cache: {cache}\n");
        }
        if let Some(avoided) = node.calls_avoided {
            out += &format!(
                "node calls avoided: {:.1} % of the answered requests never reached the node\n",
                avoided * 100.0
            );
        }
    }
    out += &format!("max share error: {:.1} pp\n", summary.max_share_error_pp);
    if let Some(node) = &summary.node_time {
        let fill = node.node_fill.map_or("-".into(), |f| format!("{f:.3}"));
        out += &format!(
            "node time ({:.0} ms/s given out): max share error {:.1} pp, fill {fill}\n",
            node.capacity_node_ms, node.max_node_share_error_pp
        );
        let shares: Vec<String> = summary
            .clients
            .iter()
            .filter_map(|c| Some((c, c.node_time.as_ref()?)))
            .map(|(c, t)| {
                format!(
                    "{} {:.1} % (fair {:.1} %)",
                    c.id,
                    t.node_share * 100.0,
                    t.fair_node_share * 100.0
                )
            })
            .collect();
        out += &format!("node shares: {}\n", shares.join(", "));
    }
    let seconds: Vec<String> = summary
        .admitted_by_second()
        .iter()
        .map(u64::to_string)
        .collect();
    out += &format!("admitted by second: {}\n", seconds.join(" "));
    for swap in &summary.swaps {
        out += &format!("{swap}\n");
    }
    if let Some(shadow) = &summary.shadow {
        out += &format!(
            "\nshadow candidate, checked by running it enforcing: max error {:.2} %\n",
            shadow.max_error_pct
        );
        out += &format!(
            "{:<24} {:>9} {:>13} {:>13} {:>18} {:>8}\n",
            "identity", "requests", "live refused", "would refuse", "refused enforcing", "error %"
        );
        for i in &shadow.identities {
            out += &format!(
                "{:<24} {:>9} {:>13} {:>13} {:>18} {:>8.2}\n",
                i.identity,
                i.requests,
                i.live_refused,
                i.would_refuse,
                i.refused_enforcing,
                i.error_pct
            );
        }
    }
    if let Some(fleet) = &summary.fleet {
        out += &format!(
            "\nfleet of {} replicas (each saw at least {}){}:\n",
            fleet.replicas,
            fleet.replicas_seen_min,
            fleet
                .exchange_ms
                .as_ref()
                .map_or(String::new(), |e| format!(
                    ", exchanges with Redis p50 {:.1} ms, p99 {:.1} ms",
                    e.p50, e.p99
                ))
        );
        for p in &fleet.phases {
            out += &format!(
                "  {:<11} {:>4.0}-{:<4.0} s  {:>6.1} rps ({:.3} of capacity), max share error {:.2} pp, {} failed\n",
                p.phase, p.from_s, p.to_s, p.admitted_rps, p.of_capacity, p.max_share_error_pp, p.failed
            );
        }
        for o in &fleet.redis_outages {
            let after = |s: Option<f64>| s.map_or("never".into(), |s| format!("after {s:.1} s"));
            out += &format!(
                "  Redis away {:.1}-{:.1} s: every replica on its fallback share {}, fleet shares back {}\n",
                o.at_s,
                o.back_s,
                after(o.all_on_fallback_after_s),
                after(o.fleet_shares_back_after_s)
            );
        }
    }
    for baseline in &summary.baselines {
        out += &format!(
            "\nbaseline {}: would admit {:.0} rps, max share error {:.1} pp\n",
            baseline.mechanism, baseline.admitted_rps, baseline.max_share_error_pp
        );
        out += &format!(
            "{:<14} {:>10} {:>9} {:>9}\n",
            "client", "admitted", "adm %", "stake %"
        );
        for c in &baseline.clients {
            out += &format!(
                "{:<14} {:>10.1} {:>9.1} {:>9.1}\n",
                c.id,
                c.admitted_rps,
                c.admitted_share * 100.0,
                c.stake_share * 100.0
            );
        }
    }
    out
}

pub fn run(args: &SimArgs) -> anyhow::Result<()> {
    let mut scenario = Scenario::load(&args.scenario)?;
    if args.no_filters {
        scenario.filters.clear();
        scenario.swaps.clear();
        scenario.name += " (no filters)";
    }
    let baselines: Vec<Mechanism> = args
        .baselines
        .iter()
        .filter_map(|b| Mechanism::parse(b))
        .collect();
    let summary = simulate(&scenario, &baselines)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", table(&scenario, &summary));
    }
    Ok(())
}
