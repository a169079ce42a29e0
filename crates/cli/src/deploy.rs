//! `stakegate deploy` and `stakegate rollback`: a new module or policy into
//! a running Envoy through file-based ECDS, validated first, confirmed by
//! Envoy, and kept in a history to roll back to.
//!
//! The ECDS directory (`--dir`, the one Envoy's `watched_directory` names)
//! holds one config file per filter, which Envoy reads. stakegate keeps its
//! own state beside it, under `.stakegate/`:
//!
//! - `modules/<sha256>.wasm`: every module deployed, content-addressed and
//!   written to a temp file then renamed, so a config never names a
//!   half-written module;
//! - `history/<filter>.json`: the deployments still in effect, oldest
//!   first; the last is what Envoy serves. The first deploy records the
//!   config it replaces (the one Envoy started with) as deployment 0, so
//!   `rollback` can return to it;
//! - `lock`, `ticket` and `queue/`: the deploy lock (`deploy_lock`), held
//!   by the deploy, rollback, promote or drop in progress, so two at once
//!   take turns, first come first served, instead of both writing version
//!   N and one being lost.
//!
//! A deploy: (1) checks the module declares itself the filter being
//! deployed (its `stakegate.filter` section), loads it with the policy in
//! the offline host, as `stakegate check` does, and refuses with the
//! module's reason; (2) stores
//! the module; (3) stages the new config in the filter's warm-up slot (a
//! disabled filter beside it in the gateway configs, same vm_id), where V8
//! compiles a new module while the old one serves, and waits for Envoy;
//! (4) writes the filter's own config atomically under the new version,
//! which reuses the compiled module, and waits for Envoy's admin to report
//! that version applied, or the update rejected. On a rejection (or no
//! answer) it puts the previous config file back, so what is on disk stays
//! what Envoy serves, and exits non-zero with Envoy's reason when
//! `--envoy-log` lets it read it (Envoy gives the reason only in its log).
//! A module Envoy cannot load is therefore refused in the warm-up slot,
//! before the filter is touched. (5) It records the deployment.
//! `rollback` drops the last deployment and applies the one before it the
//! same way.

use crate::check::check;
pub use crate::deploy_lock::DeployLock;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use stakegate_core::request::sha256_hex;
use stakegate_stack::admin::Admin;
use stakegate_stack::ecds::{self, EcdsUpdate, FilterConfig};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a deploy waits for one in progress before it gives up.
pub(crate) const LOCK_WAIT: Duration = Duration::from_secs(120);

/// The filters `--filter` names.
pub const FILTERS: [&str; 2] = ["admission-gate", "stake-qos"];

#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The filter: admission-gate or stake-qos.
    #[arg(long, value_parser = FILTERS)]
    pub filter: String,
    #[command(flatten)]
    pub gateway: Gateway,
    /// How long to wait for Envoy to apply or reject the change.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Envoy's log file (`--log-path`), read for the reason of a rejection.
    #[arg(long)]
    pub envoy_log: Option<PathBuf>,
}

/// Where a gateway is, for every command that reads or changes one: its
/// ECDS directory, and its Envoy's admin, which `stakegate init` wrote into
/// the directory (so `--dir` alone finds both).
#[derive(Debug, Clone, clap::Args)]
pub struct Gateway {
    /// The ECDS directory Envoy watches (`watched_directory`), as
    /// `stakegate init --dir` made it.
    #[arg(long, default_value = "envoy-config/live")]
    pub dir: PathBuf,
    /// Envoy's admin address [default: the one `stakegate init` wrote into
    /// --dir, else http://127.0.0.1:9901].
    #[arg(long)]
    pub admin: Option<String>,
}

/// Where `stakegate init` says, in the gateway's directory, its Envoy's
/// admin listens.
pub const ADMIN_FILE: &str = ".stakegate/admin";
const DEFAULT_ADMIN: &str = "http://127.0.0.1:9901";

impl Gateway {
    /// Envoy's admin: `--admin`, else the one `init` wrote into the
    /// directory, else the default.
    pub fn admin_url(&self) -> String {
        self.admin.clone().unwrap_or_else(|| {
            std::fs::read_to_string(self.dir.join(ADMIN_FILE))
                .map(|url| url.trim().to_string())
                .unwrap_or_else(|_| DEFAULT_ADMIN.to_string())
        })
    }

    pub fn admin(&self) -> Admin {
        Admin::new(&self.admin_url())
    }
}

impl Target {
    pub fn admin_url(&self) -> String {
        self.gateway.admin_url()
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct DeployArgs {
    #[command(flatten)]
    pub target: Target,
    /// The compiled filter module (default: the one the filter runs now).
    #[arg(long)]
    pub module: Option<PathBuf>,
    /// The policy document (JSON).
    #[arg(long, required_unless_present_any = ["promote", "drop"])]
    pub policy: Option<PathBuf>,
    /// Into the shadow slot instead: the candidate decides every request
    /// beside the live filter and refuses none (stake-qos).
    #[arg(long, conflicts_with_all = ["promote", "drop"])]
    pub shadow: bool,
    /// With --shadow: after this long, promote the candidate if staked
    /// identities sent at least 100 requests and would be refused at most
    /// --max-extra-refusals per cent of them more than now, else drop it.
    #[arg(long, requires = "shadow", value_parser = humantime::parse_duration)]
    pub promote_after: Option<Duration>,
    /// With --promote-after: the budget, in per cent of staked requests.
    #[arg(long, requires = "promote_after", default_value_t = 1.0)]
    pub max_extra_refusals: f64,
    /// Make the shadow candidate live (a recorded deployment) and empty the
    /// shadow slot.
    #[arg(long, conflicts_with_all = ["module", "policy", "drop"])]
    pub promote: bool,
    /// Empty the shadow slot.
    #[arg(long, conflicts_with_all = ["module", "policy"])]
    pub drop: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct RollbackArgs {
    #[command(flatten)]
    pub target: Target,
}

/// One deployment in a filter's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Deployment {
    /// The config Envoy started with, found in the directory by the first
    /// deploy (deployment 0).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub startup: bool,
    /// The ECDS `version_info` it was applied under.
    pub version: u64,
    pub module_sha256: String,
    pub policy_sha256: String,
    /// The policy text, so a rollback can write it again.
    pub policy: String,
    /// Milliseconds since the Unix epoch.
    pub applied_at_ms: u64,
    /// Staging in the warm-up slot, from its write to Envoy's confirmation
    /// (V8 compiles a new module here); absent without a slot.
    #[serde(default)]
    pub warm_up_ms: Option<u64>,
    /// The swap itself, from the config write to Envoy's confirmation.
    pub apply_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub deployments: Vec<Deployment>,
}

/// stakegate's state beside one ECDS directory.
pub(crate) struct Live {
    pub dir: PathBuf,
    pub filter: String,
}

impl Live {
    pub fn new(target: &Target) -> anyhow::Result<Self> {
        let dir = &target.gateway.dir;
        if !dir.is_dir() {
            bail!(
                "{} is not a directory: --dir must be the ECDS directory Envoy watches",
                dir.display()
            );
        }
        Ok(Self {
            dir: dir.clone(),
            filter: target.filter.clone(),
        })
    }

    pub fn state(&self, sub: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.join(".stakegate").join(sub);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(path)
    }

    fn history_path(&self) -> anyhow::Result<PathBuf> {
        Ok(self.state("history")?.join(format!("{}.json", self.filter)))
    }

    fn history(&self) -> anyhow::Result<History> {
        let path = self.history_path()?;
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{} is not a stakegate history", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(History::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    fn save(&self, history: &History) -> anyhow::Result<()> {
        write_atomically(
            &self.history_path()?,
            serde_json::to_string_pretty(history)?.as_bytes(),
        )
    }

    pub fn module_path(&self, sha256: &str) -> anyhow::Result<PathBuf> {
        Ok(self.state("modules")?.join(format!("{sha256}.wasm")))
    }

    /// Stores `module` under its sha256 (once) and returns its path.
    pub fn store_module(&self, module: &[u8], sha256: &str) -> anyhow::Result<PathBuf> {
        let path = self.module_path(sha256)?;
        if !path.exists() {
            write_atomically(&path, module)?;
        }
        Ok(path)
    }

    pub fn config(&self, module: PathBuf, policy: &str) -> FilterConfig {
        match self.filter.as_str() {
            "admission-gate" => FilterConfig::admission_gate(module, policy),
            _ => FilterConfig::stake_qos(module, policy),
        }
    }

    /// Takes the directory's deploy lock, after every deploy or rollback
    /// that asked before (`deploy_lock`), waiting up to `wait`.
    pub fn lock(&self, wait: Duration) -> anyhow::Result<DeployLock> {
        DeployLock::take(&self.state("")?, wait)
    }

    /// The history; when it is empty, the config now in the directory (the
    /// one Envoy started with) becomes deployment 0.
    /// The filter's ECDS document in the directory, if it has one.
    fn current_config(&self) -> Option<serde_json::Value> {
        let file = self.config(PathBuf::new(), "").file;
        let text = std::fs::read_to_string(self.dir.join(file)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The version the filter runs now, as its ECDS document says.
    pub fn current_version(&self) -> Option<u64> {
        self.current_config()?["version_info"]
            .as_str()?
            .parse()
            .ok()
    }

    /// The module the filter runs now, as its ECDS document names it.
    pub fn current_module(&self) -> anyhow::Result<PathBuf> {
        let doc = self.current_config();
        doc.as_ref()
            .and_then(|d| {
                d["resources"][0]["typed_config"]["config"]["vm_config"]["code"]["local"]
                    ["filename"]
                    .as_str()
            })
            .map(PathBuf::from)
            .with_context(|| {
                format!(
                    "{} runs no module in {}: give --module",
                    self.filter,
                    self.dir.display()
                )
            })
    }

    fn history_from_startup(&self) -> anyhow::Result<History> {
        let mut history = self.history()?;
        if !history.deployments.is_empty() {
            return Ok(history);
        }
        let file = self.config(PathBuf::new(), "").file;
        let Some(doc) = self.current_config() else {
            return Ok(history);
        };
        let config = &doc["resources"][0]["typed_config"]["config"];
        let module = config["vm_config"]["code"]["local"]["filename"].as_str();
        let policy = config["configuration"]["value"].as_str();
        let (Some(module), Some(policy)) = (module, policy) else {
            eprintln!(
                "warning: {} is not a config stakegate wrote; rollback cannot return to it",
                file
            );
            return Ok(history);
        };
        let bytes = std::fs::read(module).with_context(|| {
            format!("reading {module}, the module of the startup config {file}")
        })?;
        let sha256 = sha256_hex(&bytes);
        self.store_module(&bytes, &sha256)?;
        history.deployments.push(Deployment {
            startup: true,
            version: doc["version_info"]
                .as_str()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            module_sha256: sha256,
            policy_sha256: sha256_hex(policy.as_bytes()),
            policy: policy.to_string(),
            applied_at_ms: 0,
            warm_up_ms: None,
            apply_ms: 0,
        });
        Ok(history)
    }
}

/// Writes a temp file beside `path`, then renames it onto `path`.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&temp, bytes).with_context(|| format!("writing {}", temp.display()))?;
    std::fs::rename(&temp, path).with_context(|| format!("renaming onto {}", path.display()))
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The next ECDS version: above every version in the history and the one
/// in the config file now (which may predate stakegate).
pub(crate) fn next_version(history: &History, current: Option<&str>) -> u64 {
    let on_disk = current
        .and_then(|text| serde_json::from_str::<serde_json::Value>(text).ok())
        .and_then(|doc| doc["version_info"].as_str()?.parse::<u64>().ok())
        .unwrap_or(0);
    history
        .deployments
        .iter()
        .map(|d| d.version)
        .fold(on_disk, u64::max)
        + 1
}

/// Applies `policy` with the stored module `sha256` under a new version:
/// first in the filter's warm-up slot, where Envoy compiles a new module
/// while the old one keeps serving, then in the filter itself, which then
/// reuses the compiled module. On success returns the deployment; on a
/// rejection or no answer puts the previous config files back and fails
/// with Envoy's reason.
fn apply(
    live: &Live,
    target: &Target,
    history: &History,
    sha256: &str,
    policy: &str,
) -> anyhow::Result<Deployment> {
    let config = live.config(live.module_path(sha256)?, policy);
    let warm_up = config.warm_up();
    let current = std::fs::read_to_string(live.dir.join(&config.file)).ok();
    let version = next_version(history, current.as_deref());
    let admin = Admin::new(&target.admin_url());
    let version_text = |name: &str| {
        let stat = format!("extension_config_discovery.http_filter.{name}.version_text");
        admin.text(&stat).with_context(|| {
            format!(
                "cannot read Envoy's admin at {}; nothing was changed",
                admin.url
            )
        })
    };
    version_text(&config.name)?;
    // Gateway configs without the slot (version_text absent) swap cold.
    let warmed = match version_text(&warm_up.name)? {
        Some(_) => Some(write_and_confirm(live, target, &admin, &warm_up, version)?),
        None => None,
    };
    let applied = write_and_confirm(live, target, &admin, &config, version)?;
    Ok(Deployment {
        startup: false,
        version,
        module_sha256: sha256.to_string(),
        policy_sha256: sha256_hex(policy.as_bytes()),
        policy: policy.to_string(),
        applied_at_ms: now_ms(),
        warm_up_ms: warmed.map(|d| d.as_millis() as u64),
        apply_ms: applied.as_millis() as u64,
    })
}

/// Writes `config` under `version` and waits for Envoy's verdict. On a
/// rejection or no answer, puts the previous file back (what is on disk
/// stays what Envoy serves) and fails with Envoy's reason.
fn write_and_confirm(
    live: &Live,
    target: &Target,
    admin: &Admin,
    config: &FilterConfig,
    version: u64,
) -> anyhow::Result<Duration> {
    let path = live.dir.join(&config.file);
    let previous = std::fs::read_to_string(&path).ok();
    let log_start = target
        .envoy_log
        .as_ref()
        .and_then(|log| std::fs::metadata(log).ok())
        .map_or(0, |m| m.len());
    let failure = match ecds::apply(
        admin,
        &live.dir,
        config,
        &version.to_string(),
        target.timeout,
    ) {
        Ok(v) if v.update == EcdsUpdate::Applied => return Ok(v.took),
        Ok(_) => {
            let reason = target
                .envoy_log
                .as_deref()
                .and_then(|log| rejection_reason(log, log_start))
                .unwrap_or_else(|| {
                    "its reason is in Envoy's log (\"config update rejected\"); pass --envoy-log to see it here".into()
                });
            anyhow::anyhow!("Envoy rejected {} version {version}: {reason}", config.name)
        }
        Err(e) => e,
    };
    match previous {
        Some(text) => write_atomically(&path, text.as_bytes())?,
        None => std::fs::remove_file(&path).unwrap_or_default(),
    }
    Err(failure.context(format!(
        "the previous config of {} is back in {} and keeps serving",
        config.name,
        live.dir.display()
    )))
}

/// Envoy's own words about a rejected config, from its log past `from`:
/// the module's error lines and the rejection line.
fn rejection_reason(log: &Path, from: u64) -> Option<String> {
    let text = std::fs::read(log).ok()?;
    let new = String::from_utf8_lossy(text.get(from as usize..)?).into_owned();
    let lines: Vec<&str> = new
        .lines()
        .filter(|l| l.contains("config update rejected") || l.contains("wasm log"))
        .map(|l| l.rsplit("] ").next().unwrap_or(l).trim())
        .collect();
    (!lines.is_empty()).then(|| lines.join("; "))
}

pub(crate) fn print(action: &str, filter: &str, d: &Deployment) {
    let staged = d.warm_up_ms.map_or("no warm-up slot".to_string(), |ms| {
        format!("staged in the warm-up slot in {ms} ms")
    });
    println!(
        "{action} {filter} version {}: module sha256 {}, policy sha256 {}, {staged}, applied by Envoy in {} ms",
        d.version, d.module_sha256, d.policy_sha256, d.apply_ms
    );
}

pub fn deploy(args: &DeployArgs) -> anyhow::Result<()> {
    if args.promote {
        return crate::shadow::promote(&args.target);
    }
    if args.drop {
        return crate::shadow::drop(&args.target);
    }
    let Some(policy_path) = &args.policy else {
        bail!("--policy is required");
    };
    let module = match &args.module {
        Some(module) => module.clone(),
        None => Live::new(&args.target)?.current_module()?,
    };
    let module = &module;
    let policy = std::fs::read_to_string(policy_path)
        .with_context(|| format!("reading {}", policy_path.display()))?;
    let context = || format!("{} with {}", module.display(), policy_path.display());
    if args.shadow {
        let auto = args.promote_after.map(|after| crate::shadow::Auto {
            after,
            max_extra: args.max_extra_refusals,
        });
        return crate::shadow::deploy(&args.target, module, &policy, auto).with_context(context);
    }
    let deployment = deploy_policy(&args.target, module, &policy).with_context(context)?;
    print("deployed", &args.target.filter, &deployment);
    Ok(())
}

/// A deploy of `module` with the policy text `policy`, as `stakegate
/// deploy` does it, returning what was applied (scenario runs swap
/// policies under load this way).
pub fn deploy_policy(target: &Target, module: &Path, policy: &str) -> anyhow::Result<Deployment> {
    let live = Live::new(target)?;
    let module_bytes = validated(&target.filter, module, policy)?;
    let turn = live.lock(LOCK_WAIT)?;
    deploy_in_turn(&live, target, &module_bytes, policy, &turn)
}

/// A deploy of a validated module, in a turn of the deploy lock already
/// taken (a promote takes one turn for the deploy and the drop after it).
pub(crate) fn deploy_in_turn(
    live: &Live,
    target: &Target,
    module_bytes: &[u8],
    policy: &str,
    _turn: &DeployLock,
) -> anyhow::Result<Deployment> {
    let sha256 = sha256_hex(module_bytes);
    live.store_module(module_bytes, &sha256)?;
    let mut history = live.history_from_startup()?;
    let deployment = apply(live, target, &history, &sha256, policy)?;
    history.deployments.push(deployment.clone());
    live.save(&history)?;
    Ok(deployment)
}

/// Reads `module` and checks, before Envoy is touched, that it declares
/// itself `filter` and loads with `policy` in the offline host (printing
/// the policy's warnings); returns the module's bytes.
pub(crate) fn validated(filter: &str, module: &Path, policy: &str) -> anyhow::Result<Vec<u8>> {
    let bytes = std::fs::read(module).with_context(|| format!("reading {}", module.display()))?;
    match stakegate_host::declared_filter(&bytes) {
        Some(declared) if declared == filter => {}
        declared => bail!(
            "refused before touching Envoy: the module declares itself {}, not {filter}",
            declared.map_or(
                "no stakegate filter (it has no stakegate.filter section)".into(),
                |d| format!("the {d} filter")
            ),
        ),
    }
    let checked = check(&bytes, policy.as_bytes()).context("refused before touching Envoy")?;
    for warning in &checked.warnings {
        eprintln!("warning: {warning}");
    }
    Ok(bytes)
}

/// The first config of `filter` in the ECDS directory `dir`, for Envoy to
/// start with (`stakegate init`): the module validated as a deploy
/// validates it, stored as a deploy stores it, and the filter's config and
/// warm-up slot written under version 1. The first deploy records it as
/// deployment 0, so `rollback` can return to it.
pub fn first_config(dir: &Path, filter: &str, module: &Path, policy: &str) -> anyhow::Result<()> {
    let live = Live {
        dir: dir.to_path_buf(),
        filter: filter.to_string(),
    };
    let bytes = validated(filter, module, policy)
        .with_context(|| format!("{filter}: {}", module.display()))?;
    let stored = live.store_module(&bytes, &sha256_hex(&bytes))?;
    live.config(stored, policy).write_both(dir, "1")
}

pub fn rollback(args: &RollbackArgs) -> anyhow::Result<()> {
    let live = Live::new(&args.target)?;
    let _lock = live.lock(LOCK_WAIT)?;
    let mut history = live.history()?;
    let [.., previous, current] = history.deployments.as_slice() else {
        bail!(
            "nothing to roll back to: {} has {} deployment(s) in {}",
            live.filter,
            history.deployments.len(),
            live.history_path()?.display()
        );
    };
    let from = current.version;
    let (sha256, policy) = (previous.module_sha256.clone(), previous.policy.clone());
    let startup = previous.startup;
    let mut deployment = apply(&live, &args.target, &history, &sha256, &policy)?;
    deployment.startup = startup;
    print(
        &format!("rolled back from version {from}:"),
        &live.filter,
        &deployment,
    );
    history.deployments.pop();
    history.deployments.pop();
    history.deployments.push(deployment);
    live.save(&history)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment(version: u64) -> Deployment {
        Deployment {
            startup: false,
            version,
            module_sha256: "m".into(),
            policy_sha256: "p".into(),
            policy: "{}".into(),
            applied_at_ms: 0,
            warm_up_ms: None,
            apply_ms: 0,
        }
    }

    #[test]
    fn versions_only_go_up() {
        let empty = History::default();
        assert_eq!(next_version(&empty, None), 1);
        assert_eq!(next_version(&empty, Some(r#"{"version_info": "41"}"#)), 42);
        assert_eq!(next_version(&empty, Some("not json")), 1);
        let history = History {
            deployments: vec![deployment(3), deployment(7)],
        };
        assert_eq!(next_version(&history, Some(r#"{"version_info": "5"}"#)), 8);
    }

    #[test]
    fn the_reason_comes_from_envoys_log_after_the_write() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("envoy.log");
        let old = "[2026-11-22 06:27:13.343][1][warning][config] [x.cc:81] Filesystem config update rejected: old\n";
        let new = "[2026-11-22 06:27:14.343][1][error][wasm] [context.cc:1157] wasm log stakegate.admission_gate: policy rejected: maxInflight: must be > 0\n\
                   [2026-11-22 06:27:14.344][1][warning][config] [x.cc:81] Filesystem config update rejected: Unable to create Wasm plugin stakegate.admission_gate\n";
        std::fs::write(&log, format!("{old}{new}")).unwrap();
        let reason = rejection_reason(&log, old.len() as u64).unwrap();
        assert!(reason.contains("maxInflight: must be > 0"), "{reason}");
        assert!(reason.contains("Unable to create Wasm plugin"), "{reason}");
        assert!(!reason.contains("old"), "{reason}");
        assert_eq!(rejection_reason(&log, (old.len() + new.len()) as u64), None);
    }
}
