//! Shadow deploys: a candidate stake QoS module and policy run in the
//! gateway beside the live one, in the shadow slot (a filter before it with
//! a VM and shared data of its own, `envoy-config/gateway.yaml`). It
//! decides every request as it would and refuses none; its usage ledger
//! (`stakegate.qos_shadow.usage.*`) counts what it would have refused.
//!
//! - `stakegate deploy --shadow`: validates as a deploy does, stores the
//!   module, writes the shadow slot (the policy with `"shadow": true`),
//!   waits for Envoy, and records the candidate beside the history
//!   (`.stakegate/shadow/<filter>.json`). With `--promote-after`, it
//!   watches the candidate that long and promotes it if staked identities
//!   sent at least `JUDGED` requests and would be refused at most
//!   `--max-extra-refusals` per cent of them more than now, else drops it
//!   and says why.
//! - `stakegate deploy --promote`: the candidate becomes live, a normal,
//!   recorded deployment (`rollback` undoes it); the slot is emptied.
//! - `stakegate deploy --drop`: the slot is emptied.
//! - `stakegate shadow`: live against candidate per identity, over an
//!   interval.

use crate::deploy::{self, DeployLock, Gateway, Live, Target};
use crate::usage::{self, Row, LIVE, SHADOW};
use anyhow::{bail, Context};
use clap::Args;
use serde::{Deserialize, Serialize};
use stakegate_core::qos::ledger;
use stakegate_core::request::sha256_hex;
use stakegate_stack::admin::Admin;
use stakegate_stack::ecds::{self, EcdsUpdate, FilterConfig};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The candidate in the shadow slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub module_sha256: String,
    /// The policy as the operator gave it (without `"shadow": true`).
    pub policy: String,
    pub version: u64,
    pub started_at_ms: u64,
}

#[derive(Debug, Args)]
pub struct ShadowArgs {
    #[command(flatten)]
    pub gateway: Gateway,
    /// The interval compared.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One identity over an interval, live against candidate.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Compared {
    pub identity: String,
    pub requests: u64,
    /// Not refused by anything, live; `None` where the live ledger has no
    /// row of this identity (it counted it under a shared label, such as
    /// `unstaked` or `unidentified`, and the candidate named it).
    pub admitted: Option<u64>,
    /// Refused by the live stake QoS (`None` as for `admitted`).
    pub refused: Option<u64>,
    /// Would be refused by the candidate.
    pub would_refuse: u64,
    pub share_rps: Option<f64>,
    pub would_be_share_rps: Option<f64>,
    pub staked: bool,
}

/// The two ledgers read at once.
struct Ledgers {
    live: Vec<Row>,
    shadow: Vec<Row>,
}

fn read(admin: &Admin) -> anyhow::Result<Ledgers> {
    Ok(Ledgers {
        live: usage::read_from(admin, LIVE)?,
        shadow: usage::read_from(admin, SHADOW)?,
    })
}

fn by_identity(rows: &[Row]) -> BTreeMap<&str, &Row> {
    rows.iter().map(|r| (r.identity.as_str(), r)).collect()
}

/// An identity's row now and then (`empty` if it had none), if it has one
/// now.
fn since<'a>(
    id: &str,
    now: &BTreeMap<&str, &'a Row>,
    then: &BTreeMap<&str, &'a Row>,
    empty: &'a Row,
) -> Option<(&'a Row, &'a Row)> {
    Some((
        now.get(id).copied()?,
        then.get(id).copied().unwrap_or(empty),
    ))
}

/// Live against candidate, per identity, between two reads: every
/// identity either ledger names, with the requests the one that counted
/// more of them by this identity saw. One the live ledger counted under a
/// shared label over the interval and the candidate names (an unstaked
/// address it would refuse, or any identity while the live policy only
/// counts) has no live admissions or refusals (`None`).
fn compare(before: &Ledgers, after: &Ledgers) -> Vec<Compared> {
    let (live_then, shadow_then) = (by_identity(&before.live), by_identity(&before.shadow));
    let (live_now, shadow_now) = (by_identity(&after.live), by_identity(&after.shadow));
    let empty = Row::default();
    let identities: std::collections::BTreeSet<&str> =
        live_now.keys().chain(shadow_now.keys()).copied().collect();
    let mut out: Vec<Compared> = identities
        .into_iter()
        .map(|id| {
            let requests = |(now, then): (&Row, &Row)| now.requests.saturating_sub(then.requests);
            // Live, only where it counted this identity's requests by it.
            let live = since(id, &live_now, &live_then, &empty).filter(|&r| requests(r) > 0);
            let shadow = since(id, &shadow_now, &shadow_then, &empty);
            let (shadow_now, shadow_then) = shadow.unwrap_or((&empty, &empty));
            let share = |r: &Row| r.limited.then_some(r.share_rps).flatten();
            Compared {
                identity: id.to_string(),
                requests: live
                    .map_or(0, requests)
                    .max(requests((shadow_now, shadow_then))),
                admitted: live.map(|(now, then)| now.admitted.saturating_sub(then.admitted)),
                refused: live
                    .map(|(now, then)| now.refused_by_qos().saturating_sub(then.refused_by_qos())),
                would_refuse: shadow_now
                    .refused_total()
                    .saturating_sub(shadow_then.refused_total()),
                share_rps: live.and_then(|(now, _)| share(now)),
                would_be_share_rps: share(shadow_now),
                staked: !ledger::is_shared(id) && !id.starts_with(ledger::UNSTAKED),
            }
        })
        .filter(|c| c.requests > 0)
        .collect();
    out.sort_by(|a, b| {
        b.requests
            .cmp(&a.requests)
            .then(a.identity.cmp(&b.identity))
    });
    out
}

fn table(rows: &[Compared]) -> String {
    let width = usage::identity_width(rows.iter().map(|r| r.identity.as_str()));
    let rps = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
    let count = |x: Option<u64>| x.map_or("-".into(), |x| x.to_string());
    let mut out = format!(
        "{:<width$} {:>9} {:>9} {:>9} {:>13} {:>9} {:>15}\n",
        "identity", "requests", "admitted", "refused", "would refuse", "share/s", "would-be share"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<width$} {:>9} {:>9} {:>9} {:>13} {:>9} {:>15}\n",
            r.identity,
            r.requests,
            count(r.admitted),
            count(r.refused),
            r.would_refuse,
            rps(r.share_rps),
            rps(r.would_be_share_rps)
        ));
    }
    out
}

/// Staked identities' refusals, live and by the candidate, and their
/// requests: the candidate's extra refusals in per cent of the requests.
fn extra_refusals(rows: &[Compared]) -> (f64, u64) {
    let staked = rows.iter().filter(|r| r.staked);
    let (requests, live, would) = staked.fold((0, 0, 0), |(q, l, w), r| {
        (
            q + r.requests,
            l + r.refused.unwrap_or(0),
            w + r.would_refuse,
        )
    });
    let extra = would as f64 - live as f64;
    (100.0 * extra / requests.max(1) as f64, requests)
}

/// Staked requests a verdict needs: on a handful, a candidate that would
/// refuse a tenth of them can show none refused.
const JUDGED: u64 = 100;

/// Whether a watched candidate is within `max_extra` per cent of extra
/// refusals of staked requests (and then that figure and the requests), or
/// why not.
fn verdict(rows: &[Compared], max_extra: f64) -> Result<(f64, u64), String> {
    let (extra, requests) = extra_refusals(rows);
    if requests < JUDGED {
        Err(format!(
            "staked identities sent {requests} requests while it was watched, fewer than the {JUDGED} a verdict needs: watch it longer (--promote-after)"
        ))
    } else if extra > max_extra {
        Err(format!(
            "staked identities would be refused {extra:.2} % of their {requests} requests more than now ({}), over the budget of {max_extra} %",
            refused_by_name(rows),
        ))
    } else {
        Ok((extra, requests))
    }
}

/// The staked identities the candidate would refuse more than live QoS
/// does, most first: "acme 60 of 200, …" (at most three named).
fn refused_by_name(rows: &[Compared]) -> String {
    let mut extra: Vec<(&Compared, u64)> = rows
        .iter()
        .filter(|r| r.staked)
        .map(|r| (r, r.would_refuse.saturating_sub(r.refused.unwrap_or(0))))
        .filter(|(_, n)| *n > 0)
        .collect();
    extra.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.identity.cmp(&b.0.identity)));
    let mut named: Vec<String> = extra
        .iter()
        .take(3)
        .map(|(r, n)| format!("{} {n} more of {}", r.identity, r.requests))
        .collect();
    if extra.len() > 3 {
        named.push(format!("{} more identities", extra.len() - 3));
    }
    named.join(", ")
}

pub fn run(args: &ShadowArgs) -> anyhow::Result<()> {
    let admin = args.gateway.admin();
    let before = read(&admin)?;
    if before.shadow.is_empty() {
        eprintln!("note: no shadow candidate has counted anything yet (stakegate deploy --shadow)");
    }
    std::thread::sleep(args.interval);
    let rows = compare(&before, &read(&admin)?);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", table(&rows));
        let (extra, requests) = extra_refusals(&rows);
        println!("staked identities: {requests} requests, the candidate would refuse {extra:+.2} % of them more than now");
    }
    Ok(())
}

/// Automatic promotion: watch the candidate `after`, promote it if
/// staked identities would be refused at most `max_extra` per cent more.
pub struct Auto {
    pub after: Duration,
    pub max_extra: f64,
}

fn slot(target: &Target) -> anyhow::Result<()> {
    if target.filter != "stake-qos" {
        bail!("only stake-qos runs as a shadow: the admission gate has no shadow slot yet");
    }
    Ok(())
}

/// `deploy --shadow`: the candidate into the shadow slot, recorded; with
/// `auto`, watched and then promoted or dropped.
pub fn deploy(
    target: &Target,
    module: &Path,
    policy: &str,
    auto: Option<Auto>,
) -> anyhow::Result<()> {
    slot(target)?;
    let mut doc: serde_json::Value =
        serde_json::from_str(policy).context("the policy is not JSON")?;
    let Some(fields) = doc.as_object_mut() else {
        bail!("the policy is not a JSON object");
    };
    fields.insert("shadow".into(), true.into());
    let shadowed = doc.to_string();
    let live = Live::new(target)?;
    let bytes = deploy::validated(&target.filter, module, &shadowed)?;
    let sha256 = sha256_hex(&bytes);
    let candidate = {
        let _lock = live.lock(deploy::LOCK_WAIT)?;
        let stored = live.store_module(&bytes, &sha256)?;
        let config = live.config(stored, &shadowed).shadow();
        let (version, applied) = fill(&live, target, &config).context(
            "is this Envoy's config one with a shadow slot (envoy-config/gateway.yaml)?",
        )?;
        if !applied {
            empty_slot(&live).write(&live.dir, &version.to_string())?;
            bail!("Envoy rejected the shadow candidate; the slot is empty again");
        }
        let candidate = Candidate {
            module_sha256: sha256,
            policy: policy.to_string(),
            version,
            started_at_ms: deploy::now_ms(),
        };
        save(&live, Some(&candidate))?;
        let beside = live
            .current_version()
            .map_or(String::new(), |v| format!(" version {v}"));
        println!(
            "shadow {} candidate: module sha256 {}, deciding every request beside live{beside}, refusing none (stakegate shadow --dir {} compares them; deploy --promote makes it the next version)",
            target.filter, candidate.module_sha256, target.gateway.dir.display()
        );
        candidate
    };
    let Some(auto) = auto else { return Ok(()) };
    let admin = Admin::new(&target.admin_url());
    let before = read(&admin)?;
    println!(
        "watching it for {} ...",
        humantime::format_duration(auto.after)
    );
    std::thread::sleep(auto.after);
    let rows = compare(&before, &read(&admin)?);
    print!("{}", table(&rows));
    let verdict = verdict(&rows, auto.max_extra);
    match verdict {
        Ok((extra, requests)) => {
            println!("staked identities: {extra:+.2} % refusals of {requests} requests, within {} %: promoting", auto.max_extra);
            promote(target)
        }
        Err(why) => {
            drop(target)?;
            bail!(
                "the candidate (module {}) was dropped: {why}",
                candidate.module_sha256
            )
        }
    }
}

/// The shadow slot holding nothing.
fn empty_slot(live: &Live) -> FilterConfig {
    live.config(Default::default(), "").shadow().idled()
}

/// Writes `config` into its slot under the next version and waits for
/// Envoy: the version, and whether Envoy applied it.
fn fill(live: &Live, target: &Target, config: &FilterConfig) -> anyhow::Result<(u64, bool)> {
    let current = std::fs::read_to_string(live.dir.join(&config.file)).ok();
    let version = deploy::next_version(&Default::default(), current.as_deref());
    let admin = Admin::new(&target.admin_url());
    let verdict = ecds::apply(
        &admin,
        &live.dir,
        config,
        &version.to_string(),
        target.timeout,
    )?;
    Ok((version, verdict.update == EcdsUpdate::Applied))
}

fn record_path(live: &Live) -> anyhow::Result<std::path::PathBuf> {
    Ok(live.state("shadow")?.join(format!("{}.json", live.filter)))
}

fn save(live: &Live, candidate: Option<&Candidate>) -> anyhow::Result<()> {
    let path = record_path(live)?;
    match candidate {
        Some(c) => deploy::write_atomically(&path, serde_json::to_string_pretty(c)?.as_bytes()),
        None => match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        },
    }
}

fn candidate(live: &Live) -> anyhow::Result<Candidate> {
    let path = record_path(live)?;
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "no shadow candidate for {} ({} is missing): deploy one with --shadow",
            live.filter,
            path.display()
        )
    })?;
    serde_json::from_str(&text)
        .with_context(|| format!("{} is not a shadow record", path.display()))
}

/// `deploy --drop`: the shadow slot emptied, the record removed.
pub fn drop(target: &Target) -> anyhow::Result<()> {
    slot(target)?;
    let live = Live::new(target)?;
    let turn = live.lock(deploy::LOCK_WAIT)?;
    empty(&live, target, &turn)?;
    println!("shadow {} dropped: the slot is empty", target.filter);
    Ok(())
}

/// Empties the shadow slot and removes the record, in a turn of the
/// deploy lock.
fn empty(live: &Live, target: &Target, _turn: &DeployLock) -> anyhow::Result<()> {
    if !fill(live, target, &empty_slot(live))?.1 {
        bail!("Envoy did not take the empty shadow slot");
    }
    save(live, None)
}

/// `deploy --promote`: the candidate deployed live (recorded, so
/// `rollback` undoes it), then the slot emptied, in one turn of the deploy
/// lock: a drop that comes meanwhile waits, and then finds the slot empty;
/// a promote after a drop finds no candidate.
pub fn promote(target: &Target) -> anyhow::Result<()> {
    slot(target)?;
    let live = Live::new(target)?;
    let turn = live.lock(deploy::LOCK_WAIT)?;
    let candidate = candidate(&live)?;
    let module = live.module_path(&candidate.module_sha256)?;
    let bytes = deploy::validated(&target.filter, &module, &candidate.policy)
        .context("promoting the shadow candidate")?;
    let deployment = deploy::deploy_in_turn(&live, target, &bytes, &candidate.policy, &turn)
        .context("promoting the shadow candidate")?;
    deploy::print(
        "promoted the shadow candidate:",
        &target.filter,
        &deployment,
    );
    empty(&live, target, &turn)?;
    println!("shadow {} emptied: the candidate is live", target.filter);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(identity: &str, requests: u64, refused: &[(&str, u64)], share: Option<f64>) -> Row {
        let refused: BTreeMap<String, u64> =
            refused.iter().map(|(r, n)| (r.to_string(), *n)).collect();
        let total: u64 = refused.values().sum();
        Row {
            identity: identity.into(),
            requests,
            calls: requests,
            admitted: requests - total,
            refused,
            node_ms: 0.0,
            notifications: 0,
            share_rps: share,
            limited: share.is_some(),
        }
    }

    #[test]
    fn live_against_candidate_over_the_interval() {
        let before = Ledgers {
            live: vec![
                row("acme", 100, &[("stake-share", 10)], Some(50.0)),
                row("wallet", 9, &[], None),
            ],
            shadow: vec![row("acme", 40, &[("stake-share", 30)], Some(20.0))],
        };
        let after = Ledgers {
            live: vec![
                row(
                    "acme",
                    300,
                    &[("stake-share", 20), ("gate-inflight", 5)],
                    Some(50.0),
                ),
                row(
                    "unstaked:10.0.0.0/24",
                    50,
                    &[("stake-share", 40)],
                    Some(1.0),
                ),
                row("unidentified", 7, &[], None),
                row("wallet", 9, &[], None),
            ],
            shadow: vec![
                row("acme", 240, &[("stake-share", 90)], Some(20.0)),
                row(
                    "unstaked:10.0.0.0/24",
                    50,
                    &[("stake-share", 45)],
                    Some(1.0),
                ),
                // The live policy counted these under `unidentified` (it
                // had named the wallet before).
                row("wallet", 5, &[("stake-share", 2)], Some(3.0)),
            ],
        };
        let rows = compare(&before, &after);
        let acme = rows.iter().find(|r| r.identity == "acme").unwrap();
        // 200 requests; live QoS refused 10 (the gate 5 more), the
        // candidate would refuse 60.
        assert_eq!(
            (
                acme.requests,
                acme.admitted,
                acme.refused,
                acme.would_refuse
            ),
            (200, Some(185), Some(10), 60)
        );
        assert_eq!(
            (acme.share_rps, acme.would_be_share_rps),
            (Some(50.0), Some(20.0))
        );
        assert!(acme.staked);
        assert!(
            !rows
                .iter()
                .find(|r| r.identity.starts_with("unstaked"))
                .unwrap()
                .staked
        );
        // An identity only the candidate named: its requests and refusals
        // as the candidate counted them, nothing claimed of the live ones.
        let wallet = rows.iter().find(|r| r.identity == "wallet").unwrap();
        assert_eq!(
            (
                wallet.requests,
                wallet.admitted,
                wallet.refused,
                wallet.would_refuse
            ),
            (5, None, None, 2)
        );
        assert!(wallet.staked);
        // Only staked identities count: 52 more refusals of 205 requests,
        // and the verdict names them.
        let (extra, requests) = extra_refusals(&rows);
        assert_eq!(requests, 205);
        assert!((extra - 100.0 * 52.0 / 205.0).abs() < 1e-9, "{extra}");
        assert_eq!(
            refused_by_name(&rows),
            "acme 50 more of 200, wallet 2 more of 5"
        );
        let table = table(&rows);
        assert!(table.lines().nth(1).unwrap().starts_with("acme"), "{table}");
        // Over a budget of 25 %: dropped, the identities named; within 30 %:
        // promoted, with the figure.
        let over = verdict(&rows, 25.0).unwrap_err();
        assert!(
            over.contains("25.37 % of their 205") && over.contains("acme 50 more"),
            "{over}"
        );
        assert_eq!(verdict(&rows, 30.0), Ok((extra, 205)));
        // Too few staked requests to judge by, whatever they show.
        let few: Vec<Compared> = rows.into_iter().filter(|r| r.identity != "acme").collect();
        let why = verdict(&few, 100.0).unwrap_err();
        assert!(
            why.contains("sent 5 requests") && why.contains("the 100 a verdict needs"),
            "{why}"
        );
    }
}
