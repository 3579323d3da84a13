//! Builds the policy plugins in `plugins/` for wasm32-wasip2 as part of the normal
//! build, copies them to `target/plugins/NAME.wasm`, and hands `default.wasm` to the
//! crate for embedding. Plugins build in their own target dir (`target/wasm`) so the
//! nested cargo never waits on the outer build's lock.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap().to_path_buf();
    let plugins = root.join("plugins");
    for p in ["plugins/Cargo.toml", "plugins/Cargo.lock", "wit"] {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    for crate_dir in std::fs::read_dir(&plugins).unwrap().flatten() {
        if crate_dir.path().join("Cargo.toml").exists() {
            println!("cargo:rerun-if-changed={}", crate_dir.path().display());
        }
    }
    let target_root = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let wasm_dir = target_root.join("wasm");

    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args([
        "build",
        "--release",
        "--locked",
        "--target",
        "wasm32-wasip2",
    ])
    .arg("--manifest-path")
    .arg(plugins.join("Cargo.toml"))
    .arg("--target-dir")
    .arg(&wasm_dir);
    // The outer build's flags and target settings are not the plugins'.
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("CARGO_FEATURE_")
            || k.starts_with("CARGO_CFG_")
            || matches!(
                k.as_str(),
                "RUSTFLAGS"
                    | "CARGO_ENCODED_RUSTFLAGS"
                    | "CARGO_BUILD_RUSTFLAGS"
                    | "CARGO_TARGET_DIR"
                    | "CARGO_BUILD_TARGET"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "CARGO_MAKEFLAGS"
                    | "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "PROFILE"
                    | "OPT_LEVEL"
                    | "DEBUG"
                    | "NUM_JOBS"
            )
        {
            cmd.env_remove(&k);
        }
    }
    let status = cmd.status().expect("run cargo for the plugins");
    if !status.success() {
        panic!(
            "building the policy plugins failed; is the target installed? \
             (`rustup target add wasm32-wasip2`, done by scripts/bootstrap.sh)"
        );
    }

    let built = wasm_dir.join("wasm32-wasip2/release");
    let out_plugins = target_root.join("plugins");
    std::fs::create_dir_all(&out_plugins).unwrap();
    for entry in std::fs::read_dir(&built).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "wasm") {
            let name = path
                .file_stem()
                .unwrap()
                .to_string_lossy()
                .replace('_', "-");
            copy(&path, &out_plugins.join(format!("{name}.wasm")));
        }
    }
    // Tests and tools find the built plugins here.
    println!(
        "cargo:rustc-env=MOONGATE_PLUGIN_DIR={}",
        out_plugins.display()
    );
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    copy(&built.join("default.wasm"), &out.join("default.wasm"));
}

fn copy(from: &Path, to: &Path) {
    std::fs::copy(from, to)
        .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", from.display(), to.display()));
}
