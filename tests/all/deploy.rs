//! What `deploy/` ships, checked: the Kubernetes manifests against the Kubernetes API
//! schemas (and the moongate config inside them with `moongate check-config`), the
//! systemd unit with `systemd-analyze verify`, and the documented fleet rollout (a
//! plugin moved from A to B by digest, one node first, then all; a bad artifact stops at
//! the first node) against a real registry with moongates watching their annotation
//! files. The container build's steps run in `scripts/test.sh` (deploy/container-steps.sh).

use std::process::Command;
use std::time::Duration;

use crate::supply::{OciRegistry, keypair, plugin, push, signed_copy};
use crate::support::*;

fn kubernetes_validate(files: &[std::path::PathBuf]) -> std::process::Output {
    Command::new(python())
        .args(["-m", "kubernetes_validate", "--strict", "--quiet"])
        .args(files)
        .output()
        .expect("kubernetes-validate (installed by scripts/bootstrap.sh)")
}

#[test]
fn the_kubernetes_manifests_validate_and_carry_a_valid_config() {
    let dir = repo_root().join("deploy/k8s");
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let o = kubernetes_validate(&files);
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // The check can fail: a misspelt field is refused.
    let tmp = tempdir();
    let broken = tmp.path().join("broken.yaml");
    let text = std::fs::read_to_string(dir.join("inference.yaml")).unwrap();
    std::fs::write(&broken, text.replace("readinessProbe", "readynessProbe")).unwrap();
    assert!(!kubernetes_validate(&[broken]).status.success());

    // The config the ConfigMap carries is one moongate accepts.
    let toml = tmp.path().join("moongate.toml");
    let o = Command::new(python())
        .arg("-c")
        .arg(
            "import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); \
             open(sys.argv[2], 'w').write(d['data']['moongate.toml'])",
        )
        .arg(dir.join("configmap.yaml"))
        .arg(&toml)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(env!("CARGO_BIN_EXE_moongate"))
        .arg("check-config")
        .arg(&toml)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn the_systemd_unit_verifies() {
    // `verify` checks that the commands exist: point them at this build and the
    // example config.
    let unit = std::fs::read_to_string(repo_root().join("deploy/moongate.service")).unwrap();
    let tmp = tempdir();
    let path = tmp.path().join("moongate.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/moongate", env!("CARGO_BIN_EXE_moongate"))
            .replace(
                "/etc/moongate/moongate.toml",
                repo_root().join("config/example.toml").to_str().unwrap(),
            ),
    )
    .unwrap();
    let o = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian's systemd, installed by scripts/bootstrap.sh)");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success() && all.trim().is_empty(), "{all}");
    for hardening in [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "RestrictAddressFamilies=",
        "CapabilityBoundingSet=",
        "SystemCallFilter=@system-service",
    ] {
        assert!(unit.contains(hardening), "{hardening}");
    }
}

/// How long a node may take to pull and compile an announced plugin: a bound, not a
/// speed check. A debug build took 12-16 s per plugin beside two busy processes and
/// other tests (CI, 2026-12-02), against ~3 s on a quiet machine.
const PLUGIN_LOAD: Duration = Duration::from_secs(90);

/// The rollout of docs/operations.md on three nodes: each moongate watches its own
/// directory, as the pod's downward-API volume presents the `moongate.dev/policy`
/// annotation (`policy.oci`).
#[test]
fn a_fleet_moves_from_a_to_b_by_digest_in_stages() {
    let reg = OciRegistry::start();
    let keys = tempdir();
    let (trusted, sec) = keypair(keys.path(), "team");
    let a = push(
        &signed_copy(keys.path(), "lru", "a.wasm", Some(&sec)),
        &reg.reference("moongate/policy:a"),
    );
    let b = push(
        &signed_copy(keys.path(), "prefix-evict", "b.wasm", Some(&sec)),
        &reg.reference("moongate/policy:b"),
    );
    // Signed by nobody the fleet trusts: must stop at the first node.
    let bad = push(
        &signed_copy(keys.path(), "put-budget", "bad.wasm", None),
        &reg.reference("moongate/policy:bad"),
    );
    let nodes: Vec<(tempfile::TempDir, Moongate)> = (0..3)
        .map(|_| {
            let watch = tempdir();
            std::fs::write(watch.path().join("policy.oci"), format!("{a}\n")).unwrap();
            let mg = Moongate::start_config(&format!(
                "[master_face]\nupstream = \"127.0.0.1:1\"\n\
                 [policy]\nactive = \"policy\"\ntrusted_keys = [\"{trusted}\"]\n\
                 watch_dir = \"{}\"\nwatch_interval_ms = 200\n\
                 [[policy.plugins]]\nname = \"policy\"\nfrom = \"{a}\"\n",
                watch.path().display()
            ));
            (watch, mg)
        })
        .collect();
    let on = |mg: &Moongate| plugin(mg, "policy")["source"].as_str().unwrap().to_string();
    let annotate = |i: usize, reference: &str| {
        std::fs::write(
            nodes[i].0.path().join("policy.oci"),
            format!("{reference}\n"),
        )
        .unwrap()
    };
    // On it means loaded from it and active: the catalog names the new source when the
    // load ends, and the swap that activates it follows (a moment later on a busy
    // machine: seen as "loaded").
    let wait_on = |i: usize, reference: &str| {
        wait_for(
            "node on its annotated plugin",
            PLUGIN_LOAD,
            &[&nodes[i].1.proc, &reg.proc],
            || on(&nodes[i].1) == reference && plugin(&nodes[i].1, "policy")["state"] == "active",
        )
    };
    for (_, mg) in &nodes {
        assert_eq!(on(mg), a);
    }
    // Stage 1: one node.
    annotate(0, &b);
    wait_on(0, &b);
    assert_eq!(plugin(&nodes[0].1, "policy")["state"], "active");
    assert_eq!((on(&nodes[1].1), on(&nodes[2].1)), (a.clone(), a.clone()));
    // Stage 2: all.
    for i in 1..3 {
        annotate(i, &b);
    }
    for i in 0..3 {
        wait_on(i, &b);
    }
    // A bad artifact announced to the first node is refused there; it keeps B.
    annotate(0, &bad);
    wait_for(
        "the bad artifact refused",
        PLUGIN_LOAD,
        &[&nodes[0].1.proc],
        || {
            nodes[0]
                .1
                .metric("moongate_plugin_signature_refusals_total{reason=\"unsigned\"}")
                >= 1.0
        },
    );
    assert_eq!(on(&nodes[0].1), b);
    assert_eq!(plugin(&nodes[0].1, "policy")["state"], "active");
}
