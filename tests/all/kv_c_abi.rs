//! The C ABI (`libmoongate_kv`, `clients/rust/include/moongate_kv.h`) from a C program
//! built here with the system's C compiler, against a real master and moongate: over
//! the Unix socket with the static library, over TCP with the shared one.

use std::path::PathBuf;
use std::process::Command;

use crate::support::*;

/// Where cargo puts the library: beside the moongate binary the tests run.
fn lib_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_moongate"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds the library as a C user does (`cargo build -p moongate-kv`), into the tests'
/// target directory: a test run of this crate alone leaves the .a and .so as they were.
fn build_library() {
    let profile = lib_dir();
    let target = profile.parent().unwrap();
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cargo
        .args(["build", "--locked", "-p", "moongate-kv", "--target-dir"])
        .arg(target)
        .current_dir(repo_root());
    if profile.file_name().is_some_and(|n| n == "release") {
        cargo.arg("--release");
    }
    let o = cargo.output().expect("cargo");
    assert!(
        o.status.success(),
        "cargo build -p moongate-kv:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Compiles tests/c/kv_abi.c against the library (`static`: libmoongate_kv.a, else the
/// .so); the compiler's output is in the panic.
fn build(out: &std::path::Path, static_lib: bool) -> PathBuf {
    let root = repo_root();
    let lib = lib_dir();
    let exe = out.join(if static_lib {
        "kv_abi_static"
    } else {
        "kv_abi_shared"
    });
    let mut cc = Command::new("cc");
    cc.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-D_GNU_SOURCE",
        "-o",
    ])
    .arg(&exe)
    .arg(root.join("tests/c/kv_abi.c"))
    .arg("-I")
    .arg(root.join("clients/rust/include"));
    if static_lib {
        cc.arg(lib.join("libmoongate_kv.a"));
    } else {
        cc.arg("-L").arg(&lib).arg("-lmoongate_kv");
    }
    cc.args(["-lpthread", "-ldl", "-lm", "-lrt"]);
    let o = cc.output().expect("a C compiler (cc)");
    assert!(
        o.status.success(),
        "cc failed (is {} built? cargo builds it with the workspace):\n{}{}",
        lib.join("libmoongate_kv.a").display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

#[test]
fn a_c_program_uses_every_call_over_both_listeners() {
    let master = Master::start();
    let dir = tempdir();
    let sock = dir.path().join("kv.sock");
    let (mg, kv) = kv_moongate(
        &master,
        &format!(
            "segment_bytes = 33554432\nunix_path = \"{}\"\n",
            sock.display()
        ),
    );
    wait_segment_mounted(&mg);
    build_library();
    let mut shm_calls = Vec::new();
    for (static_lib, address, prefix) in [
        (true, format!("unix:{}", sock.display()), "c-unix"),
        (false, format!("tcp:{kv}"), "c-tcp"),
    ] {
        let exe = build(dir.path(), static_lib);
        let mut run = Command::new(&exe);
        run.args([&address, prefix]);
        if !static_lib {
            run.env("LD_LIBRARY_PATH", lib_dir());
        }
        let o = run.output().unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            o.status.success() && said.contains("all ok"),
            "{} over {address}:\n{said}\n--- moongate ---\n{}",
            exe.display(),
            mg.proc.log_text()
        );
        // Over the Unix socket, mg_alloc memory took the shared-memory path (one
        // registration, each kind of call); over TCP nothing does.
        let m = mg.metrics();
        let shm = |op: &str| {
            metric_value(
                &m,
                &format!("moongate_kv_shm_calls_total{{op=\"{op}\",result=\"ok\"}}"),
            )
        };
        let now: Vec<f64> = ["register", "put_from", "get_into", "batch_get_into"]
            .iter()
            .map(|op| shm(op))
            .collect();
        if static_lib {
            assert!(
                now.iter().all(|&n| n >= 1.0),
                "over {address}: {now:?}\n{m}"
            );
        } else {
            assert_eq!(now, shm_calls, "no shared memory over {address}");
        }
        shm_calls = now;
    }
    // Registrations end with their connections.
    wait_for(
        "shared memory released",
        std::time::Duration::from_secs(10),
        &[&mg.proc],
        || metric_value(&mg.metrics(), "moongate_kv_shm_registered_bytes") == 0.0,
    );
    // Every connection the programs opened was closed with them.
    for listener in ["http", "unix"] {
        let open = format!("moongate_kv_connections{{listener=\"{listener}\"}}");
        wait_for(
            &format!("{listener} connections closed"),
            std::time::Duration::from_secs(10),
            &[&mg.proc],
            || metric_value(&mg.metrics(), &open) == 0.0,
        );
    }
}
