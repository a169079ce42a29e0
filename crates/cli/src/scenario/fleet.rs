//! A run with several gateway replicas (`gateway.replicas`): while the load
//! runs, Redis is stopped and started as `gateway.redis_outages` say, and
//! every replica's fleet gauges are sampled ten times a second; the summary
//! gets a `fleet` section with the run cut into phases (before the first
//! outage, during each, and from two seconds after each), each with its
//! admitted rate against the capacity and its share error, and each
//! outage's measured fallback and recovery.

use super::stack::Stack;
use super::Scenario;
use crate::summary::{
    fairness, ExchangeLatency, FleetPhase, FleetSummary, Outage, Summary, WARMUP_S,
};
use stakegate_stack::admin::Admin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// Shares are measured again from this long after Redis is back.
const SETTLE_S: f64 = 2.0;

/// What the watch saw: when Redis was really stopped and back, and how
/// many replicas were on the fallback share at each sample.
#[derive(Debug, Default)]
pub struct Watched {
    /// `(stopped_s, back_s)`, seconds into the run.
    outages: Vec<(f64, f64)>,
    /// `(at_s, replicas on the fallback share, replicas each sees at least)`.
    samples: Vec<(f64, usize, i64)>,
    /// The slowest replica's exchange round trip, p50 and p99 over the run.
    exchange_ms: Option<(f64, f64)>,
}

/// Runs the outages and samples the replicas until `done`.
pub fn watch(
    scenario: &Scenario,
    stack: &Stack,
    started: Instant,
    done: &AtomicBool,
) -> anyhow::Result<Watched> {
    let admins: Vec<Admin> = stack
        .gateways()
        .iter()
        .map(|g| Admin::new(&g.admin_url))
        .collect();
    let mut watched = Watched::default();
    let mut outages = scenario.redis_outages.iter().peekable();
    let mut down_since: Option<(f64, f64)> = None;
    while !done.load(Ordering::Relaxed) {
        let now = started.elapsed().as_secs_f64();
        match down_since {
            None => {
                if let Some(&&(at, length)) = outages.peek() {
                    if now >= at.as_secs_f64() {
                        outages.next();
                        stack.redis_down(true)?;
                        let stopped = started.elapsed().as_secs_f64();
                        eprintln!("[scenario] {stopped:.1} s: Redis stopped");
                        down_since = Some((stopped, length.as_secs_f64()));
                    }
                }
            }
            Some((stopped, length)) if now >= stopped + length => {
                stack.redis_down(false)?;
                let back = started.elapsed().as_secs_f64();
                eprintln!("[scenario] {back:.1} s: Redis back");
                watched.outages.push((stopped, back));
                down_since = None;
            }
            Some(_) => {}
        }
        let (mut fallback, mut replicas) = (0, i64::MAX);
        for admin in &admins {
            let Ok(stats) = admin.matching("stakegate\\.qos\\.fleet\\.") else {
                continue;
            };
            let gauge = |name: &str| {
                stats
                    .iter()
                    .find(|s| s["name"].as_str().is_some_and(|n| n.ends_with(name)))
                    .and_then(|s| s["value"].as_i64())
            };
            fallback += usize::from(gauge("fleet.fallback") == Some(1));
            replicas = replicas.min(gauge("fleet.replicas").unwrap_or(0));
        }
        watched.samples.push((now, fallback, replicas));
        std::thread::sleep(SAMPLE_EVERY);
    }
    if let Some((stopped, _)) = down_since {
        // The run ended first: Redis comes back for whoever runs next.
        stack.redis_down(false)?;
        watched
            .outages
            .push((stopped, started.elapsed().as_secs_f64()));
    }
    for admin in &admins {
        let quantiles = admin.histogram("wasmcustom.stakegate.qos.fleet.exchange_ms")?;
        let at = |percent: f64| {
            quantiles
                .iter()
                .find(|q| q.percent == percent)
                .and_then(|q| q.cumulative)
        };
        if let (Some(p50), Some(p99)) = (at(50.0), at(99.0)) {
            let (a, b) = watched.exchange_ms.unwrap_or_default();
            watched.exchange_ms = Some((a.max(p50), b.max(p99)));
        }
    }
    Ok(watched)
}

/// The `fleet` section of a run's summary.
pub fn summarise(scenario: &Scenario, summary: &Summary, watched: Watched) -> FleetSummary {
    let seconds = summary.seconds();
    let parties = summary.parties();
    let phase = |name: &str, from: f64, to: f64| -> Option<FleetPhase> {
        let range = (from.ceil() as usize)..(to.floor() as usize).min(seconds);
        if range.is_empty() {
            return None;
        }
        let column = |f: fn(&stakegate_loadgen::report::Second) -> u64| -> Vec<Vec<u64>> {
            summary
                .clients
                .iter()
                .map(|c| c.timeline.iter().map(f).collect())
                .collect()
        };
        let admitted = column(|s| s.ok);
        let shares = fairness(
            &parties,
            &column(|s| s.ok + s.rejected + s.failed),
            &admitted,
            summary.capacity_rps,
            range.clone(),
        );
        let total: u64 = admitted.iter().flat_map(|c| c[range.clone()].iter()).sum();
        let failed: u64 = summary
            .clients
            .iter()
            .flat_map(|c| {
                c.timeline[range.start.min(c.timeline.len())..range.end.min(c.timeline.len())]
                    .iter()
            })
            .map(|s| s.failed)
            .sum();
        let rate = total as f64 / range.len() as f64;
        Some(FleetPhase {
            phase: name.to_string(),
            from_s: range.start as f64,
            to_s: range.end as f64,
            admitted_rps: round(rate),
            of_capacity: round(rate / summary.capacity_rps),
            max_share_error_pp: shares.max_error_pp,
            failed,
        })
    };
    let end = seconds as f64;
    let first = watched.outages.first().map_or(end, |o| o.0);
    let mut phases: Vec<FleetPhase> = phase("fleet", WARMUP_S as f64, first).into_iter().collect();
    let mut outages = Vec::new();
    for (i, &(stopped, back)) in watched.outages.iter().enumerate() {
        let next = watched.outages.get(i + 1).map_or(end, |o| o.0);
        phases.extend(phase("redis away", stopped, back));
        phases.extend(phase("redis back", back + SETTLE_S, next));
        let all_fell_back = watched
            .samples
            .iter()
            .find(|&&(t, fallback, _)| t >= stopped && fallback == scenario.replicas)
            .map(|&(t, ..)| round(t - stopped));
        let recovered = watched
            .samples
            .iter()
            .find(|&&(t, fallback, _)| t >= back && fallback == 0)
            .map(|&(t, ..)| round(t - back));
        outages.push(Outage {
            at_s: round(stopped),
            back_s: round(back),
            all_on_fallback_after_s: all_fell_back,
            fleet_shares_back_after_s: recovered,
        });
    }
    FleetSummary {
        replicas: scenario.replicas,
        replicas_seen_min: watched
            .samples
            .iter()
            .filter(|&&(t, ..)| t >= WARMUP_S as f64 && t < first)
            .map(|&(.., seen)| seen)
            .min()
            .unwrap_or(0),
        phases,
        redis_outages: outages,
        exchange_ms: watched
            .exchange_ms
            .map(|(p50, p99)| ExchangeLatency { p50, p99 }),
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
