//! File-based ECDS: the filter configs Envoy watches in its ECDS directory.
//!
//! Each filter's `TypedExtensionConfig` lives in its own file; it is
//! replaced atomically (a temp file in the same directory, then a rename),
//! which is the event Envoy's `watched_directory` reacts to, so Envoy never
//! reads a half-written file.

use crate::admin::Admin;
use anyhow::{bail, Context};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The suffix of a filter's shadow slot's names.
const SHADOW: &str = "shadow";

/// One Wasm filter as Envoy loads it.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterConfig {
    /// The ECDS resource name, which is also the filter's name in the HCM.
    pub name: String,
    /// The Wasm plugin's name and root_id (the same for the warm-up slot).
    pub plugin: String,
    /// The file under the ECDS directory.
    pub file: String,
    /// Stable across swaps, so the filter's shared data survives them.
    pub vm_id: String,
    pub module: PathBuf,
    /// The policy document, passed as the plugin configuration.
    pub policy: String,
    /// Envoy's environment variables the VM may read (stake QoS: fleet
    /// mode's credentials, `STAKEGATE_FLEET_AUTH`).
    pub env_keys: Vec<String>,
    /// The slot holds no Wasm at all but a native filter that does nothing
    /// (a header mutation with no mutations): an empty shadow slot.
    pub idle: bool,
}

impl FilterConfig {
    pub fn admission_gate(module: impl Into<PathBuf>, policy: impl Into<String>) -> Self {
        Self {
            name: "stakegate.admission_gate".into(),
            plugin: "stakegate.admission_gate".into(),
            file: "admission-gate.yaml".into(),
            vm_id: "stakegate.admission_gate".into(),
            module: module.into(),
            policy: policy.into(),
            env_keys: Vec::new(),
            idle: false,
        }
    }

    /// The ECDS document (JSON, which Envoy reads as YAML).
    pub fn stake_qos(module: impl Into<PathBuf>, policy: impl Into<String>) -> Self {
        Self {
            name: "stakegate.stake_qos".into(),
            plugin: "stakegate.stake_qos".into(),
            file: "stake-qos.yaml".into(),
            vm_id: "stakegate.stake_qos".into(),
            module: module.into(),
            policy: policy.into(),
            env_keys: vec![stakegate_core::qos::fleet::AUTH_ENV.into()],
            idle: false,
        }
    }

    /// Any other proxy-wasm module as a filter of its own (`name`, its own
    /// vm_id), e.g. the bench's no-op reference filter.
    pub fn other(name: &str, module: impl Into<PathBuf>, policy: impl Into<String>) -> Self {
        Self {
            name: format!("stakegate.{name}"),
            plugin: format!("stakegate.{name}"),
            file: format!("{name}.yaml"),
            vm_id: format!("stakegate.{name}"),
            module: module.into(),
            policy: policy.into(),
            env_keys: Vec::new(),
            idle: false,
        }
    }

    /// A copy under its own names and VM (`suffix` appended), to run beside
    /// another config of the same filter in one Envoy: VMs with different
    /// ids share no data.
    pub fn named(&self, suffix: &str) -> Self {
        let stem = self.file.trim_end_matches(".yaml");
        Self {
            name: format!("{}.{suffix}", self.name),
            plugin: format!("{}.{suffix}", self.plugin),
            file: format!("{stem}.{suffix}.yaml"),
            vm_id: format!("{}.{suffix}", self.vm_id),
            ..self.clone()
        }
    }

    /// This filter's entry in an HTTP connection manager's `http_filters`,
    /// loaded through file-based ECDS from `{{ECDS_DIR}}`, indented as in
    /// `envoy-config/bench/listener.yaml`.
    pub fn http_filter_entry(&self) -> String {
        format!(
            r#"          - name: {name}
            config_discovery:
              config_source:
                path_config_source:
                  path: {{{{ECDS_DIR}}}}/{file}
                  watched_directory: {{ path: {{{{ECDS_DIR}}}} }}
              type_urls: ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]"#,
            name = self.name,
            file = self.file,
        )
    }

    /// The filter's warm-up slot: a disabled filter beside it in the
    /// gateway configs, same vm_id and module, where a deploy stages a new
    /// module so that V8 compiles it before the real swap.
    pub fn warm_up(&self) -> Self {
        let stem = self.file.trim_end_matches(".yaml");
        Self {
            name: format!("{}.next", self.name),
            file: format!("{stem}.next.yaml"),
            ..self.clone()
        }
    }

    /// The filter's shadow slot (`stakegate deploy --shadow`): a filter
    /// before it in the gateway config, with a VM and shared data of its
    /// own, where a candidate decides every request and refuses none.
    pub fn shadow(&self) -> Self {
        self.named(SHADOW)
    }

    /// Whether this is a filter's shadow slot.
    pub fn is_shadow(&self) -> bool {
        self.name
            .rsplit_once('.')
            .is_some_and(|(_, suffix)| suffix == SHADOW)
    }

    /// The same slot holding nothing (`idle`).
    pub fn idled(&self) -> Self {
        Self {
            idle: true,
            ..self.clone()
        }
    }

    /// Writes this config and its warm-up slot's (the same) into `dir`,
    /// and its shadow slot, empty, if it has no file yet. A shadow slot's
    /// config is written alone: the slot has neither.
    pub fn write_both(&self, dir: &Path, version: &str) -> anyhow::Result<()> {
        self.write(dir, version)?;
        if self.is_shadow() {
            return Ok(());
        }
        self.warm_up().write(dir, version)?;
        let shadow = self.shadow().idled();
        if !dir.join(&shadow.file).exists() {
            shadow.write(dir, version)?;
        }
        Ok(())
    }

    pub fn render(&self, version: &str) -> anyhow::Result<String> {
        let typed_config = if self.idle {
            json!({
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            })
        } else {
            self.wasm()?
        };
        let doc = json!({
            "version_info": version,
            "resources": [{
                "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": self.name,
                "typed_config": typed_config,
            }],
        });
        Ok(serde_json::to_string_pretty(&doc)?)
    }

    /// The Wasm filter's typed config.
    fn wasm(&self) -> anyhow::Result<serde_json::Value> {
        let module = std::fs::canonicalize(&self.module)
            .with_context(|| format!("module {}", self.module.display()))?;
        Ok(json!({
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": self.plugin,
                "root_id": self.plugin,
                "vm_config": {
                    "vm_id": self.vm_id,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": module } },
                    "environment_variables": { "host_env_keys": self.env_keys },
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": self.policy,
                },
                // A VM that traps is replaced by a fresh one (its held
                // slots expire by the stale-slot TTL) rather than either
                // failing every request or waving them all through
                // unprotected.
                "failure_policy": "FAIL_RELOAD",
            },
        }))
    }

    /// Writes the config into `dir` atomically and returns its path.
    pub fn write(&self, dir: &Path, version: &str) -> anyhow::Result<PathBuf> {
        let text = self.render(version)?;
        let path = dir.join(&self.file);
        let temp = dir.join(format!(".{}.{}.tmp", self.file, std::process::id()));
        std::fs::write(&temp, text).with_context(|| format!("writing {}", temp.display()))?;
        std::fs::rename(&temp, &path)
            .with_context(|| format!("renaming onto {}", path.display()))?;
        Ok(path)
    }
}

/// Envoy's verdict on an ECDS update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EcdsUpdate {
    Applied,
    Rejected,
}

/// An update Envoy answered, and how long after the write it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub update: EcdsUpdate,
    pub took: Duration,
}

/// Writes `config` as `version` into the ECDS directory `dir` and waits for
/// Envoy at `admin` to answer: applied when the filter's `version_text`
/// reads `version`, rejected when its `update_rejected` grows. (Envoy bumps
/// `config_reload` for rejected updates too, and its config dump shows the
/// rejected resource, so neither tells the two apart.)
pub fn apply(
    admin: &Admin,
    dir: &Path,
    config: &FilterConfig,
    version: &str,
    timeout: Duration,
) -> anyhow::Result<Verdict> {
    let prefix = format!("extension_config_discovery.http_filter.{}.", config.name);
    // One admin request per poll, and not too many: the admin runs on
    // Envoy's main thread, which is also the one applying the update.
    let pattern = format!(
        "^{}(version_text|update_rejected)$",
        prefix.replace('.', "\\.")
    );
    let read = || -> anyhow::Result<(Option<String>, i64)> {
        let stats = admin.matching(&pattern)?;
        let value = |what: &str| {
            stats
                .iter()
                .find(|s| s["name"].as_str() == Some(&format!("{prefix}{what}")))
                .map(|s| s["value"].clone())
        };
        Ok((
            value("version_text").and_then(|v| v.as_str().map(str::to_string)),
            value("update_rejected")
                .and_then(|v| v.as_i64())
                .unwrap_or(0),
        ))
    };
    let (_, rejected) = read()?;
    let started = Instant::now();
    config.write(dir, version)?;
    while started.elapsed() < timeout {
        std::thread::sleep(Duration::from_millis(20));
        let (applied, now_rejected) = read()?;
        let update = if applied.as_deref() == Some(version) {
            EcdsUpdate::Applied
        } else if now_rejected > rejected {
            EcdsUpdate::Rejected
        } else {
            continue;
        };
        return Ok(Verdict {
            update,
            took: started.elapsed(),
        });
    }
    bail!(
        "Envoy at {} neither applied nor rejected {} version {version} within {timeout:?}: is it watching {} with a filter named {}?",
        admin.url,
        config.name,
        dir.display(),
        config.name
    )
}
