//! `stakegate demo`: "tip under RPC flood" (docs/background.md part 5), for
//! real, side by side.
//!
//! It is `stakegate scenario run tip-flood` twice, with the flood's length
//! and Envoy's workers from the command line: "no-gate" with no filter in
//! the way (`--no-filters`), "gate" with the scenario's admission gate.
//! Each run writes its own results under `--out` (`no-gate/`, `gate/`);
//! the demo adds the two summaries side by side in `summary.json` and
//! prints them as one table.

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
    #[arg(long, default_value = "results/tip-flood")]
    pub out: PathBuf,
    /// Envoy worker threads.
    #[arg(long, default_value_t = 2)]
    pub concurrency: u32,
}

const SCENARIO: &str = "tip-flood";

/// The two runs: a name, and whether the scenario's filters are left out.
const VARIANTS: [(&str, bool); 2] = [("no-gate", true), ("gate", false)];

#[derive(Debug, Serialize)]
struct DemoSummary {
    scenario: &'static str,
    variants: BTreeMap<&'static str, Summary>,
}

pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    println!(
        "tip under RPC flood: `stakegate scenario run {SCENARIO}` for {:?}, \
         without the gate and with it.\n",
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
        ("flood offered rps", |s| {
            client(s, "flood", |c| format!("{:.0}", c.offered_rps))
        }),
        ("flood answered 200", |s| status(s, "flood", "200")),
        ("flood rejected 503", |s| status(s, "flood", "503")),
        ("flood timed out", |s| status(s, "flood", "timeout")),
        ("flood transport errors", |s| {
            status(s, "flood", "transport_error")
        }),
        ("admitted rps", |s| {
            client(s, "flood", |c| format!("{:.0}", c.admitted_rps))
        }),
        ("admitted p50 ms", |s| {
            client(s, "flood", |c| format!("{:.1}", c.latency_ms.p50))
        }),
        ("admitted p99 ms", |s| {
            client(s, "flood", |c| format!("{:.1}", c.latency_ms.p99))
        }),
        ("rejected p99 ms", |s| {
            client(s, "flood", |c| format!("{:.2}", c.rejected_latency_ms.p99))
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
