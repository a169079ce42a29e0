//! `stakegate demo`: the whole gateway under a flood, for real, side by
//! side with no gateway at all.
//!
//! It is `stakegate scenario run gateway` twice, with the flood's length
//! and Envoy's workers from the command line: "no-filters" with nothing in
//! the way (`--no-filters`), "gateway" with stake QoS and the admission
//! gate (envoy-config/gateway.yaml). Each run writes its own results under
//! `--out` (`no-filters/`, `gateway/`); the demo adds the two summaries side
//! by side in `summary.json` and prints them as one table.

use crate::scenario::run::{run_and_record, RunArgs};
use crate::summary::{ClientSummary, NodeSummary, Summary};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// How long the flood lasts.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub flood: Duration,
    /// Where the results go.
    #[arg(long, default_value = "results/demo")]
    pub out: PathBuf,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    pub concurrency: u32,
}

const SCENARIO: &str = "gateway";

/// The two runs: a name, and whether the scenario's filters are left out.
const VARIANTS: [(&str, bool); 2] = [("no-filters", true), ("gateway", false)];

#[derive(Debug, Serialize)]
struct DemoSummary {
    scenario: &'static str,
    variants: BTreeMap<&'static str, Summary>,
}

pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    println!(
        "staked and unstaked clients flooding a node: `stakegate scenario run {SCENARIO}` \
         for {:?}, without filters and through the whole gateway.\n",
        args.flood
    );
    let mut variants = BTreeMap::new();
    for (name, no_filters) in VARIANTS {
        println!("[{name}]");
        let (_, summary) = run_and_record(&RunArgs {
            scenario: SCENARIO.into(),
            json: false,
            out: Some(args.out.join(name)),
            no_filters,
            concurrency: Some(args.concurrency),
            stack: None,
            duration: Some(args.flood),
        })?;
        variants.insert(name, summary);
    }
    println!("\n{}", table(&variants));
    crate::summary::write(
        &args.out,
        &DemoSummary {
            scenario: SCENARIO,
            variants,
        },
    )
}

fn table(variants: &BTreeMap<&str, Summary>) -> String {
    type Cell = fn(&Summary) -> String;
    let rows: &[(&str, Cell)] = &[
        ("public offered rps", |s| {
            format!("{:.0}", public(s).map(|c| c.offered_rps).sum::<f64>())
        }),
        ("public answered 200", |s| public_status(s, "200")),
        ("throttled 429 (QoS)", |s| public_status(s, "429")),
        ("shed 503 (gate)", |s| public_status(s, "503")),
        ("timed out", |s| public_status(s, "timeout")),
        ("transport errors", |s| public_status(s, "transport_error")),
        ("admitted rps", |s| {
            format!("{:.0}", public(s).map(|c| c.admitted_rps).sum::<f64>())
        }),
        ("admitted p99 ms (worst)", |s| {
            format!("{:.1}", worst(s, |c| c.latency_ms.p99))
        }),
        ("rejected p99 ms (worst)", |s| {
            format!("{:.2}", worst(s, |c| c.rejected_latency_ms.p99))
        }),
        ("max share error pp", |s| {
            format!("{:.2}", s.max_share_error_pp)
        }),
        ("node queue max", |s| node(s, |n| n.queue_max.to_string())),
        ("node tip lag max ms", |s| {
            node(s, |n| format!("{:.0}", n.tip_lag_max_ms))
        }),
        ("tip lost", |s| node(s, |n| n.tip_lost.to_string())),
        ("internal answered 200", |s| status(s, "internal", "200")),
        ("internal not answered 200", |s| {
            client(s, "internal", |c| {
                let all: u64 = c.status_counts.values().sum();
                (all - c.status_counts.get("200").copied().unwrap_or(0)).to_string()
            })
        }),
    ];
    let columns: Vec<(&str, &Summary)> = VARIANTS
        .iter()
        .filter_map(|(name, _)| Some((*name, variants.get(name)?)))
        .collect();
    let mut out = format!("{:<26}", "");
    for (name, _) in &columns {
        out += &format!("{name:>14}");
    }
    out.push('\n');
    for (label, cell) in rows {
        out += &format!("{label:<26}");
        for (_, summary) in &columns {
            out += &format!("{:>14}", cell(summary));
        }
        out.push('\n');
    }
    out
}

fn public(s: &Summary) -> impl Iterator<Item = &ClientSummary> {
    s.clients.iter().filter(|c| c.public)
}

fn public_status(s: &Summary, key: &str) -> String {
    let count = |c: &ClientSummary| c.status_counts.get(key).copied().unwrap_or(0);
    public(s).map(count).sum::<u64>().to_string()
}

/// The largest of `f` over the public clients.
fn worst(s: &Summary, f: fn(&ClientSummary) -> f64) -> f64 {
    public(s).map(f).fold(0.0, f64::max)
}

fn client(s: &Summary, id: &str, f: impl Fn(&ClientSummary) -> String) -> String {
    s.client(id).map_or("-".into(), f)
}

fn status(s: &Summary, id: &str, key: &str) -> String {
    client(s, id, |c| {
        c.status_counts.get(key).copied().unwrap_or(0).to_string()
    })
}

fn node(s: &Summary, f: fn(&NodeSummary) -> String) -> String {
    s.node.as_ref().map_or("-".into(), f)
}
