//! The command-line contract scripts and operators depend on.

use std::process::Command;
use std::time::Duration;

use crate::support::*;

fn moongate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moongate"))
}

#[test]
fn help_lists_the_subcommands() {
    let out = moongate().arg("--help").output().unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("run") && s.contains("check-config"), "{s}");
    let out = moongate().args(["run", "--help"]).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    for flag in ["--config", "--listen", "--upstream", "--admin"] {
        assert!(s.contains(flag), "{flag} missing:\n{s}");
    }
}

#[test]
fn check_config_accepts_the_shipped_configs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for f in ["config/reference.toml", "config/example.toml"] {
        let out = moongate()
            .arg("check-config")
            .arg(root.join(f))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn check_config_reports_every_problem_and_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.toml");
    std::fs::write(
        &f,
        "[master_face]\nupstream = \"nohost\"\nmax_frame_bytes = 10\n[log]\nlevel = \"[\"\n",
    )
    .unwrap();
    let out = moongate().arg("check-config").arg(&f).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let s = String::from_utf8_lossy(&out.stderr);
    for key in [
        "master_face.upstream",
        "master_face.max_frame_bytes",
        "log.level",
    ] {
        assert!(s.contains(key), "{key} not reported:\n{s}");
    }
    std::fs::write(&f, "[master_face]\nlisten_address = \"127.0.0.1:1\"\n").unwrap();
    let out = moongate().arg("check-config").arg(&f).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field"));
    let out = moongate()
        .arg("check-config")
        .arg(dir.path().join("missing.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn run_refuses_a_bad_flag_value_before_binding() {
    let out = moongate()
        .args(["run", "--upstream", "not-an-address"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("master_face.upstream"));
}

/// Flags override the file, so the file is judged with them: a file that sets
/// `kv.unix_path` and leaves `kv.listen` to `--kv` starts; without `--kv` it is refused
/// with the reason.
#[test]
fn run_validates_the_file_with_its_flags_applied() {
    let dir = tempdir();
    let cfg = dir.path().join("moongate.toml");
    let sock = dir.path().join("kv.sock");
    std::fs::write(
        &cfg,
        format!(
            "[kv]\nunix_path = \"{}\"\nmetadata_url = \"http://127.0.0.1:1/metadata\"\n",
            sock.display()
        ),
    )
    .unwrap();
    let out = moongate()
        .arg("run")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("set kv.listen"));
    let admin = format!("127.0.0.1:{}", free_port());
    let mut cmd = moongate();
    cmd.arg("run").arg("--config").arg(&cfg).args([
        "--kv",
        &format!("127.0.0.1:{}", free_port()),
        "--listen",
        &format!("127.0.0.1:{}", free_port()),
        "--admin",
        &admin,
    ]);
    let proc = Proc::spawn("moongate", cmd, dir.path().join("moongate.log"));
    wait_for("moongate /live", Duration::from_secs(60), &[&proc], || {
        http_get(&admin, "/live").is_some_and(|(s, _)| s == 200)
    });
    wait_for(
        "the kv face's Unix socket",
        Duration::from_secs(10),
        &[&proc],
        || sock.exists(),
    );
}
