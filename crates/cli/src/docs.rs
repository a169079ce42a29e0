//! `stakegate docs`: the policy fields and metrics the code declares, and
//! (`--check`) whether the docs' tables say the same. Each policy's page in
//! `policies/` has tables whose first columns are `field | default` and
//! `stat | type`; every field the policy reads (with its default) and every
//! metric the filter declares (with its kind) must be in them, and nothing
//! else. `make lint` runs the check, so a field or metric added, renamed or
//! given another default without its docs fails the build.

use anyhow::{bail, Context};
use clap::Args;
use stakegate_core::gate::counts::{self as gate_counts, Snapshot as GateSnapshot};
use stakegate_core::gate::policy::GatePolicy;
use stakegate_core::metrics::Metric;
use stakegate_core::qos::counts::{self as qos_counts, Snapshot as QosSnapshot};
use stakegate_core::qos::policy::QosPolicy;
use stakegate_core::validate::FieldDoc;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct DocsArgs {
    /// Compare the docs' tables with the code; exit 1 with every difference.
    #[arg(long)]
    check: bool,
    /// The repository whose `policies/` are checked.
    #[arg(long, default_value = ".")]
    root: PathBuf,
}

/// One policy's page, and what the code says belongs in it.
struct Page {
    file: &'static str,
    fields: Vec<FieldDoc>,
    /// Full stat names (with their `<label>`) and kinds.
    metrics: Vec<(String, &'static str)>,
}

fn metrics<T>(prefix: &str, list: &[Metric<T>]) -> Vec<(String, &'static str)> {
    list.iter()
        .map(|m| (format!("{prefix}.{}", m.name), m.kind.name()))
        .collect()
}

fn pages() -> Vec<Page> {
    vec![
        Page {
            file: "policies/admission-gate.md",
            fields: GatePolicy::fields(),
            metrics: metrics::<GateSnapshot>("stakegate.gate", gate_counts::METRICS),
        },
        Page {
            file: "policies/stake-qos.md",
            fields: QosPolicy::fields(),
            metrics: metrics::<QosSnapshot>("stakegate.qos", qos_counts::METRICS),
        },
    ]
}

pub fn run(args: &DocsArgs) -> anyhow::Result<()> {
    if !args.check {
        for page in pages() {
            println!("{}", page.file);
            println!("| field | default |");
            for f in &page.fields {
                println!("| `{}` | `{}` |", f.name, f.default);
            }
            println!("| stat | type |");
            for (name, kind) in &page.metrics {
                println!("| `{name}` | {kind} |");
            }
        }
        return Ok(());
    }
    let mut problems = Vec::new();
    for page in pages() {
        let path = args.root.join(page.file);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        problems.extend(check(&page, &text));
    }
    if problems.is_empty() {
        return Ok(());
    }
    for p in &problems {
        println!("{p}");
    }
    bail!(
        "{} difference(s) between the docs and the code",
        problems.len()
    )
}

/// A row of a table: its line, name (first cell) and second cell.
struct Row {
    line: usize,
    name: String,
    second: String,
}

/// The rows of every table whose header starts with `first | second`.
fn rows(text: &str, first: &str, second: &str) -> Vec<Row> {
    let cells = |line: &str| -> Vec<String> {
        line.trim()
            .trim_matches('|')
            .split(" | ")
            .map(|c| c.trim().to_string())
            .collect()
    };
    let mut out = Vec::new();
    let mut in_table = false;
    for (i, line) in text.lines().enumerate() {
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let c = cells(line);
        if c.len() >= 2 && c[0] == first && c[1] == second {
            in_table = true;
            continue;
        }
        if in_table && !line.starts_with("|---") {
            out.push(Row {
                line: i + 1,
                name: c[0].trim_matches('`').to_string(),
                second: c.get(1).cloned().unwrap_or_default(),
            });
        }
    }
    out
}

/// A default as both sides write it: no backticks, no spaces, a JSON
/// string without its quotes.
fn normal(default: &str) -> String {
    let plain: String = default.chars().filter(|c| *c != '`' && *c != ' ').collect();
    serde_json::from_str::<String>(&plain).unwrap_or(plain)
}

fn check(page: &Page, text: &str) -> Vec<String> {
    let file = page.file;
    let mut problems = Vec::new();
    let documented = rows(text, "field", "default");
    for field in &page.fields {
        match documented.iter().find(|r| r.name == field.name) {
            None => problems.push(format!(
                "{file}: field `{}` (default `{}`) is not in its table",
                field.name, field.default
            )),
            Some(row) if normal(&row.second) != normal(&field.default) => problems.push(format!(
                "{file}:{}: `{}` has default {} in the docs, `{}` in the code",
                row.line, field.name, row.second, field.default
            )),
            Some(_) => {}
        }
    }
    for row in &documented {
        if !page.fields.iter().any(|f| f.name == row.name) {
            problems.push(format!(
                "{file}:{}: `{}` is not a field of this policy",
                row.line, row.name
            ));
        }
    }
    let stats = rows(text, "stat", "type");
    for (name, kind) in &page.metrics {
        match stats.iter().find(|r| &r.name == name) {
            None => problems.push(format!(
                "{file}: metric `{name}` ({kind}) is not in its table"
            )),
            Some(row) if row.second != *kind => problems.push(format!(
                "{file}:{}: `{name}` is a {} in the docs, a {kind} in the code",
                row.line, row.second
            )),
            Some(_) => {}
        }
    }
    for row in &stats {
        if !page.metrics.iter().any(|(name, _)| *name == row.name) {
            problems.push(format!(
                "{file}:{}: `{}` is not a metric of this filter",
                row.line, row.name
            ));
        }
    }
    problems
}
