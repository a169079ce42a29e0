//! `stakegate usage`: stake QoS's usage ledger, read from a running
//! Envoy's admin (`stakegate.qos.usage.<label>.<counter>`, see
//! `stakegate_core::qos::ledger`), as a table or JSON.

use crate::deploy::Gateway;
use anyhow::Context;
use clap::Args;
use serde::Serialize;
use stakegate_core::qos::ledger::{self, COUNTERS, REFUSED, SHARE, UNLIMITED};
use stakegate_stack::admin::Admin;
use std::collections::BTreeMap;

/// The live stake QoS's ledger, and a shadow candidate's.
pub const LIVE: &str = "wasmcustom.stakegate.qos.usage.";
pub const SHADOW: &str = "wasmcustom.stakegate.qos_shadow.usage.";

/// The rules a stake QoS refuses by (the gate's are further on).
pub const QOS_RULES: [&str; 3] = ["stake-share", "concurrency", "websockets"];

#[derive(Debug, Args)]
pub struct UsageArgs {
    #[command(flatten)]
    pub gateway: Gateway,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One label's counts since Envoy started.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Row {
    pub identity: String,
    pub requests: u64,
    pub calls: u64,
    /// Requests not refused, by QoS or by the gate further on.
    pub admitted: u64,
    /// Refused requests, by rule.
    pub refused: BTreeMap<String, u64>,
    #[serde(rename = "nodeMs")]
    pub node_ms: f64,
    /// Notifications its WebSockets' subscriptions brought it.
    pub notifications: u64,
    /// Its share as QoS last gave it, in calls per second; `None` for a
    /// label of several identities, or while QoS does not limit it.
    #[serde(rename = "shareRps")]
    pub share_rps: Option<f64>,
    /// QoS limited it to that share (it was throttling when it last came).
    pub limited: bool,
}

impl Row {
    /// Its share for a person: calls per second, `no limit`, or `-` for a
    /// label of several identities.
    pub fn share_text(&self) -> String {
        match self.share_rps {
            Some(rps) if self.limited => format!("{rps:.1}"),
            _ if ledger::is_shared(&self.identity) => "-".into(),
            _ => "no limit".into(),
        }
    }
}

impl Row {
    pub fn refused_total(&self) -> u64 {
        self.refused.values().sum()
    }

    /// Refused by stake QoS's own rules.
    pub fn refused_by_qos(&self) -> u64 {
        QOS_RULES
            .iter()
            .filter_map(|rule| self.refused.get(*rule))
            .sum()
    }
}

/// The ledger as Envoy has it, busiest first: the live one's, or under
/// `prefix` (`SHADOW`) another's.
pub fn read(admin: &Admin) -> anyhow::Result<Vec<Row>> {
    read_from(admin, LIVE)
}

pub fn read_from(admin: &Admin, prefix: &str) -> anyhow::Result<Vec<Row>> {
    let filter = format!("^{}", prefix.replace('.', "\\."));
    let stats = admin
        .matching(&filter)
        .with_context(|| format!("reading the usage ledger from {}", admin.url))?;
    let named = stats
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?, s["value"].as_u64()?)));
    Ok(rows(prefix, named))
}

/// Rows from `(stat name, value)` pairs under `prefix`.
pub fn rows<'a>(prefix: &str, stats: impl Iterator<Item = (&'a str, u64)>) -> Vec<Row> {
    let mut by_label: BTreeMap<String, Row> = BTreeMap::new();
    for (name, value) in stats {
        let Some((label, counter)) = name.strip_prefix(prefix).and_then(split) else {
            continue;
        };
        let row = by_label.entry(label.to_string()).or_insert_with(|| Row {
            identity: label.to_string(),
            ..Row::default()
        });
        match counter {
            Counter::Plain("requests") => row.requests = value,
            Counter::Plain("calls") => row.calls = value,
            Counter::Plain(SHARE) => {
                row.limited = value != UNLIMITED;
                row.share_rps = row.limited.then_some(value as f64 / 1000.0);
            }
            Counter::Plain("notifications") => row.notifications = value,
            Counter::Plain(_) => row.node_ms = value as f64 / 1000.0,
            Counter::Refused(rule) => {
                row.refused.insert(rule.to_string(), value);
            }
        }
    }
    let mut rows: Vec<Row> = by_label.into_values().collect();
    for row in &mut rows {
        row.admitted = row.requests.saturating_sub(row.refused_total());
    }
    rows.sort_by(|a, b| {
        b.requests
            .cmp(&a.requests)
            .then(a.identity.cmp(&b.identity))
    });
    rows
}

enum Counter<'a> {
    Plain(&'a str),
    Refused(&'a str),
}

/// `<label>.<counter>`: the label may hold dots (an IPv4 group), the
/// counter is one of the ledger's.
fn split(rest: &str) -> Option<(&str, Counter<'_>)> {
    let (head, last) = rest.rsplit_once('.')?;
    if let Some((label, refused)) = head.rsplit_once('.') {
        if refused == REFUSED {
            return Some((label, Counter::Refused(last)));
        }
    }
    (COUNTERS.contains(&last) || last == SHARE).then_some((head, Counter::Plain(last)))
}

/// The width of a table's identity column.
pub fn identity_width<'a>(identities: impl Iterator<Item = &'a str>) -> usize {
    identities.map(str::len).max().unwrap_or(0).max(8)
}

/// The table: a line per label, the refusals by rule at the end; the
/// node's time only when it was measured (in node time).
pub fn table(rows: &[Row]) -> String {
    let width = identity_width(rows.iter().map(|r| r.identity.as_str()));
    let node_time = rows.iter().any(|r| r.node_ms > 0.0);
    let mut out = format!(
        "{:<width$} {:>10} {:>10} {:>10} {:>9}",
        "identity", "requests", "calls", "admitted", "refused"
    );
    if node_time {
        out.push_str(&format!(" {:>11}", "node ms"));
    }
    out.push_str("  refused by rule\n");
    for row in rows {
        let mut line = format!(
            "{:<width$} {:>10} {:>10} {:>10} {:>9}",
            row.identity,
            row.requests,
            row.calls,
            row.admitted,
            row.refused_total(),
        );
        if node_time {
            line.push_str(&format!(" {:>11.1}", row.node_ms));
        }
        let rules: Vec<String> = row
            .refused
            .iter()
            .map(|(r, n)| format!("{r}={n}"))
            .collect();
        if !rules.is_empty() {
            line.push_str(&format!("  {}", rules.join(" ")));
        }
        out.push_str(&line);
        out.push('\n');
    }
    if rows.is_empty() {
        out.push_str(
            "(no requests yet, or the ledger is off: usage.series and usage.addressSeries 0)\n",
        );
    }
    out
}

pub fn run(args: &UsageArgs) -> anyhow::Result<()> {
    let rows = read(&args.gateway.admin())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", table(&rows));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_names_become_rows_busiest_first() {
        let stats = [
            ("wasmcustom.stakegate.qos.usage.desk-7.requests", 10),
            ("wasmcustom.stakegate.qos.usage.desk-7.calls", 40),
            (
                "wasmcustom.stakegate.qos.usage.desk-7.refused.stake-share",
                3,
            ),
            (
                "wasmcustom.stakegate.qos.usage.desk-7.refused.gate-inflight",
                1,
            ),
            ("wasmcustom.stakegate.qos.usage.desk-7.node_us", 2500),
            (
                "wasmcustom.stakegate.qos.usage.desk-7.share_milli_rps",
                12500,
            ),
            (
                "wasmcustom.stakegate.qos.usage.unstaked:10.0.0.0/24.requests",
                50,
            ),
            (
                "wasmcustom.stakegate.qos.usage.unstaked:10.0.0.0/24.refused.concurrency",
                5,
            ),
            ("wasmcustom.stakegate.qos.usage.other.bogus", 1),
            ("wasmcustom.stakegate.qos.admitted.staked", 1),
        ];
        let rows = rows(LIVE, stats.into_iter());
        let ids: Vec<&str> = rows.iter().map(|r| r.identity.as_str()).collect();
        assert_eq!(ids, ["unstaked:10.0.0.0/24", "desk-7"]);
        let desk = &rows[1];
        assert_eq!((desk.requests, desk.calls, desk.admitted), (10, 40, 6));
        assert_eq!((desk.node_ms, desk.share_rps), (2.5, Some(12.5)));
        assert_eq!(desk.share_text(), "12.5");
        assert_eq!(rows[0].share_rps, None);
        assert_eq!(rows[0].share_text(), "no limit");
        assert_eq!(desk.refused["stake-share"], 3);
        assert_eq!(rows[0].admitted, 45);
        let table = table(&rows);
        assert!(table.contains("concurrency=5"), "{table}");
        assert!(table.contains("node ms"), "{table}");
        assert!(table.lines().count() == 3, "{table}");
    }
}
