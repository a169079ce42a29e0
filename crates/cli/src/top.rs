//! `stakegate top`: a running gateway as `top` shows a machine. Two reads
//! of Envoy's admin stats an interval apart give rates: per identity (the
//! usage ledger) its requests, what it got against the share QoS gives it,
//! its refusals by rule; the gateway's load against QoS's capacity, the
//! gate's requests in flight and what it sheds, coalescing, the answer
//! cache, the fleet.
//! Live in the terminal (q or Esc quits), or once on stdout (`--once`).

use crate::deploy::Gateway;
use crate::usage::{self, Row};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
use ratatui::text::Line;
use ratatui::widgets::Paragraph;
use stakegate_stack::admin::Admin;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub gateway: Gateway,
    /// Print one view, an interval's rates, and exit.
    #[arg(long)]
    pub once: bool,
    /// The interval rates are measured over (the ledger is handed to Envoy
    /// every quarter second, so a few seconds give rates within a few %).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// Identities shown, busiest first.
    #[arg(long, default_value_t = 20)]
    pub rows: usize,
}

/// What one read of the admin holds.
struct Reading {
    stats: BTreeMap<String, i64>,
    ledger: Vec<Row>,
}

fn read(admin: &Admin) -> anyhow::Result<Reading> {
    Ok(Reading {
        stats: admin.stats()?,
        ledger: usage::read(admin)?,
    })
}

/// The view of the interval between `before` and `after`, `rows` identities.
fn view(before: &Reading, after: &Reading, seconds: f64, rows: usize) -> Vec<String> {
    let stat = |r: &Reading, name: &str| {
        let full = format!("wasmcustom.stakegate.{name}");
        r.stats.get(&full).copied().unwrap_or(0)
    };
    let sum = |r: &Reading, prefix: &str| -> i64 {
        let full = format!("wasmcustom.stakegate.{prefix}");
        r.stats
            .iter()
            .filter(|(name, _)| name.starts_with(&full))
            .map(|(_, v)| *v)
            .sum()
    };
    let rate = |now: i64, then: i64| (now - then).max(0) as f64 / seconds;
    let per_s = |prefix: &str| rate(sum(after, prefix), sum(before, prefix));
    let mut out = Vec::new();
    let capacity = stat(after, "qos.capacity_rps");
    // The load estimate is what QoS decides by, in its unit: while it only
    // counts, each request at the most calls its body could hold (an upper
    // bound, several times the request rate), so the rate is shown too.
    let requests = per_s("qos.admitted.") + per_s("qos.throttled.") + per_s("qos.counted");
    let counting = stat(after, "qos.counting") > 0;
    out.push(format!(
        "qos   requests {requests:.0}/s   load {} of {} /s ({:.0} %{})   throttling {}   counting {}   identities {}",
        stat(after, "qos.load_rps"),
        capacity,
        100.0 * stat(after, "qos.load_rps") as f64 / capacity.max(1) as f64,
        if counting { ", an upper bound while counting" } else { "" },
        yes(stat(after, "qos.throttling")),
        yes(counting as i64),
        stat(after, "qos.identities"),
    ));
    out.push(format!(
        "gate  in flight {}   admitted {:.0}/s   shed {:.0}/s   websockets {}   coalescing {}   waiting for a slot {}",
        sum(after, "gate.inflight."),
        per_s("gate.admitted."),
        per_s("gate.rejected."),
        stat(after, "gate.websocket.active"),
        if stat(after, "gate.dedup.engaged") > 0 { "engaged" } else { "standing by" },
        stat(after, "gate.node_time.waiting"),
    ));
    let looked_up = per_s("gate.cache.hits") + per_s("gate.cache.misses");
    let unread = per_s("gate.cache.standing_by");
    if looked_up > 0.0 || unread > 0.0 || stat(after, "gate.cache.entries") > 0 {
        out.push(format!(
            "cache hits {:.0}/s ({:.0} % of lookups)   misses {:.0}/s   passed unread {:.0}/s   kept {}   {:.1} MiB",
            per_s("gate.cache.hits"),
            100.0 * per_s("gate.cache.hits") / looked_up.max(f64::MIN_POSITIVE),
            per_s("gate.cache.misses"),
            unread,
            stat(after, "gate.cache.entries"),
            stat(after, "gate.cache.bytes") as f64 / (1024.0 * 1024.0),
        ));
    }
    // A fleet's line only where one is at work (its gauges exist on every
    // gateway).
    let fleet_seen = stat(after, "qos.fleet.replicas") > 0
        || stat(after, "qos.fleet.fallback") > 0
        || sum(after, "qos.fleet.exchange") > 0;
    if fleet_seen {
        out.push(format!(
            "fleet replicas {}   fallback {}   exchange failures {:.1}/s",
            stat(after, "qos.fleet.replicas"),
            yes(stat(after, "qos.fleet.fallback")),
            per_s("qos.fleet.exchange_failures"),
        ));
    }
    out.push(String::new());
    out.extend(identities(before, after, seconds, rows));
    out
}

fn yes(flag: i64) -> &'static str {
    if flag > 0 {
        "yes"
    } else {
        "no"
    }
}

/// A line per identity, busiest over the interval first.
fn identities(before: &Reading, after: &Reading, seconds: f64, rows: usize) -> Vec<String> {
    let earlier: BTreeMap<&str, &Row> = before
        .ledger
        .iter()
        .map(|r| (r.identity.as_str(), r))
        .collect();
    let empty = Row::default();
    let mut lines: Vec<(f64, String)> = after
        .ledger
        .iter()
        .map(|now| {
            let then = earlier
                .get(now.identity.as_str())
                .copied()
                .unwrap_or(&empty);
            let rate = |a: u64, b: u64| a.saturating_sub(b) as f64 / seconds;
            let requests = rate(now.requests, then.requests);
            let admitted = rate(now.admitted, then.admitted);
            let share = now.share_text();
            let refused: Vec<String> = now
                .refused
                .iter()
                .map(|(rule, n)| (rule, rate(*n, then.refused.get(rule).copied().unwrap_or(0))))
                .filter(|(_, r)| *r > 0.0)
                .map(|(rule, r)| format!("{rule} {r:.0}/s"))
                .collect();
            let node = rate(
                (now.node_ms * 1000.0) as u64,
                (then.node_ms * 1000.0) as u64,
            );
            let line = format!(
                "{:<24} {:>9.1} {:>10.1} {:>10} {:>11.1}  {}",
                now.identity,
                requests,
                admitted,
                share,
                node / 1000.0,
                refused.join(", ")
            );
            (requests, line)
        })
        .collect();
    lines.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut out = vec![format!(
        "{:<24} {:>9} {:>10} {:>10} {:>11}  refused by rule",
        "identity", "req/s", "admitted/s", "share/s", "node ms/s"
    )];
    out.extend(lines.into_iter().take(rows).map(|(_, line)| line));
    if after.ledger.is_empty() {
        out.push("(no requests yet, or the usage ledger is off)".into());
    }
    out
}

pub fn run(args: &TopArgs) -> anyhow::Result<()> {
    let admin = args.gateway.admin();
    let seconds = args.interval.as_secs_f64().max(0.001);
    let mut before = read(&admin)?;
    if args.once {
        std::thread::sleep(args.interval);
        let after = read(&admin)?;
        println!("{}", view(&before, &after, seconds, args.rows).join("\n"));
        return Ok(());
    }
    let mut terminal = ratatui::init();
    let result = (|| -> anyhow::Result<()> {
        loop {
            if event::poll(args.interval)? {
                if let Event::Key(key) = event::read()? {
                    let ctrl_c = key.modifiers.contains(KeyModifiers::CONTROL)
                        && key.code == KeyCode::Char('c');
                    if matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                        return Ok(());
                    }
                }
                continue;
            }
            let after = read(&admin)?;
            let mut lines = vec![format!(
                "stakegate top — {}   every {}   q quits",
                admin.url,
                humantime::format_duration(args.interval)
            )];
            lines.extend(view(&before, &after, seconds, args.rows));
            terminal.draw(|frame| {
                let text: Vec<Line> = lines.iter().map(|l| Line::from(l.as_str())).collect();
                frame.render_widget(Paragraph::new(text), frame.area());
            })?;
            before = after;
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(stats: &[(&str, i64)], ledger: Vec<Row>) -> Reading {
        Reading {
            stats: stats
                .iter()
                .map(|(n, v)| (format!("wasmcustom.stakegate.{n}"), *v))
                .collect(),
            ledger,
        }
    }

    #[test]
    fn the_view_gives_rates_over_the_interval() {
        let desk = |requests: u64, refused: u64| Row {
            identity: "desk-7".into(),
            requests,
            calls: requests,
            admitted: requests - refused,
            refused: [("stake-share".to_string(), refused)].into(),
            node_ms: 0.0,
            notifications: 0,
            share_rps: Some(40.0),
            limited: true,
        };
        let before = reading(
            &[("gate.rejected.default", 10), ("gate.cache.hits", 100)],
            vec![desk(100, 10)],
        );
        let after = reading(
            &[
                ("gate.rejected.default", 30),
                ("gate.cache.hits", 400),
                ("gate.cache.misses", 100),
                ("gate.cache.standing_by", 40),
                ("gate.cache.entries", 12),
                ("gate.cache.bytes", 3 << 20),
                ("gate.inflight.default", 7),
                ("qos.load_rps", 380),
                ("qos.capacity_rps", 400),
                ("qos.throttling", 1),
            ],
            vec![desk(300, 60)],
        );
        let view = view(&before, &after, 2.0, 10).join("\n");
        assert!(
            view.contains("load 380 of 400 /s (95 %)   throttling yes"),
            "{view}"
        );
        assert!(
            view.contains("in flight 7") && view.contains("shed 10/s"),
            "{view}"
        );
        assert!(!view.contains("fleet"), "no fleet, no fleet line: {view}");
        assert!(
            view.contains("cache hits 150/s (75 % of lookups)   misses 50/s   passed unread 20/s   kept 12   3.0 MiB"),
            "{view}"
        );
        let line = view.lines().find(|l| l.starts_with("desk-7")).unwrap();
        // 200 requests in 2 s, 150 admitted, share 40/s, 25 refusals a second.
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&fields[1..4], ["100.0", "75.0", "40.0"], "{line}");
        assert!(line.ends_with("stake-share 25/s"), "{line}");
    }

    /// A quiet gateway: QoS only counts, its load is a bound of the calls
    /// the bodies could hold, and no fleet is at work (its gauges are 0).
    #[test]
    fn a_quiet_gateway_shows_its_request_rate_beside_the_bound_and_no_fleet() {
        let before = reading(&[("qos.counted", 1000)], vec![]);
        let after = reading(
            &[
                ("qos.counted", 1140),
                ("qos.load_rps", 325),
                ("qos.capacity_rps", 1600),
                ("qos.counting", 1),
                ("qos.fleet.replicas", 0),
                ("qos.fleet.fallback", 0),
            ],
            vec![],
        );
        let view = view(&before, &after, 2.0, 10).join("\n");
        assert!(
            view.contains(
                "qos   requests 70/s   load 325 of 1600 /s (20 %, an upper bound while counting)"
            ),
            "{view}"
        );
        assert!(!view.contains("fleet"), "{view}");
    }
}
