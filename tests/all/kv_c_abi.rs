//! The C ABI (`libmoongate_kv`, `clients/rust/include/moongate_kv.h`) from a C program
//! built here with the system's C compiler, against a real master and moongate: over
//! the Unix socket with the static library, over TCP with the shared one, over QUIC
//! (with a client certificate) with the static one.

use std::path::PathBuf;
use std::process::Command;

use crate::support::*;

/// Where cargo puts the library: beside the moongate binary the tests run.
pub(crate) fn lib_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_moongate"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Builds the library as a C user does (`cargo build -p moongate-kv`), into the tests'
/// target directory: a test run of this crate alone leaves the .a and .so as they were.
pub(crate) fn build_library() {
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
    compile_c(out, "kv_abi", static_lib)
}

/// Compiles tests/c/`name`.c against the library into `out` (`static`: libmoongate_kv.a,
/// else the .so); the compiler's output is in the panic.
pub(crate) fn compile_c(out: &std::path::Path, name: &str, static_lib: bool) -> PathBuf {
    let root = repo_root();
    let lib = lib_dir();
    let exe = out.join(if static_lib {
        format!("{name}_static")
    } else {
        format!("{name}_shared")
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
    .arg(root.join(format!("tests/c/{name}.c")))
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

/// A CA (its PEM path, for `kv.api_quic_client_ca`) and a client certificate it issued
/// with its key (PEM paths), as an engine on another host holds them.
fn engine_cert(dir: &std::path::Path) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["engines-ca".to_string()]).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = p.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(vec!["engine-3".to_string()]).unwrap();
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, &ca, &ca_key).unwrap();
    let paths = ["ca.pem", "engine.pem", "engine.key"].map(|n| dir.join(n));
    std::fs::write(&paths[0], ca.pem()).unwrap();
    std::fs::write(&paths[1], cert.pem()).unwrap();
    std::fs::write(&paths[2], key.serialize_pem()).unwrap();
    let [ca, cert, key] = paths;
    (ca, cert, key)
}

#[test]
fn a_c_program_uses_every_call_over_each_listener() {
    let master = Master::start();
    let dir = tempdir();
    let (ca, cert, key) = engine_cert(dir.path());
    let (mg, kv, sock) = kv_unix_moongate(
        &master,
        dir.path(),
        33554432,
        &format!(
            "api_quic_listen = \"127.0.0.1:0\"\napi_quic_client_ca = \"{}\"\n",
            ca.display()
        ),
    );
    let (quic, sha) = crate::kv_quic::api_quic_of(&mg);
    let sha: String = sha.iter().map(|b| format!("{b:02x}")).collect();
    build_library();
    let mut shm_calls = Vec::new();
    for (static_lib, address, prefix, extra) in [
        (true, format!("unix:{}", sock.display()), "c-unix", vec![]),
        (false, format!("tcp:{kv}"), "c-tcp", vec![]),
        (
            true,
            format!("quic:{quic}"),
            "c-quic",
            vec![sha, cert.display().to_string(), key.display().to_string()],
        ),
    ] {
        let exe = build(dir.path(), static_lib);
        let mut run = Command::new(&exe);
        run.args([&address, prefix]).args(&extra);
        if !static_lib {
            run.env("LD_LIBRARY_PATH", lib_dir());
        }
        let o = run.output().unwrap();
        all_ok(&format!("{} over {address}", exe.display()), &o, &mg);
        // Over the Unix socket, mg_alloc memory took the shared-memory path (one
        // registration, each kind of call); over TCP nothing does.
        let m = mg.metrics();
        let shm = |op: &str| {
            metric_value(
                &m,
                &format!("moongate_kv_shm_calls_total{{op=\"{op}\",result=\"ok\"}}"),
            )
        };
        let now: Vec<f64> = [
            "register",
            "put_from",
            "get_into",
            "batch_get_into",
            "batch_put_from",
        ]
        .iter()
        .map(|op| shm(op))
        .collect();
        if address.starts_with("unix:") {
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
    for listener in ["http", "unix", "quic_api"] {
        let open = format!("moongate_kv_connections{{listener=\"{listener}\"}}");
        wait_for(
            &format!("{listener} connections closed"),
            std::time::Duration::from_secs(10),
            &[&mg.proc],
            || metric_value(&mg.metrics(), &open) == 0.0,
        );
    }
}

/// Configures and builds tests/cpp (the C++ engine gate) with CMake into `out`.
fn build_gate(out: &std::path::Path, asan: bool) -> PathBuf {
    let root = repo_root();
    let build = out.join(if asan { "gate-asan" } else { "gate" });
    let configure = Command::new("cmake")
        .arg("-S")
        .arg(root.join("tests/cpp"))
        .arg("-B")
        .arg(&build)
        .arg(format!(
            "-DMOONGATE_INCLUDE={}",
            root.join("clients/rust/include").display()
        ))
        .arg(format!("-DMOONGATE_LIB={}", lib_dir().display()))
        .arg(format!(
            "-DMOONGATE_ASAN={}",
            if asan { "ON" } else { "OFF" }
        ))
        .output()
        .expect("cmake (scripts/bootstrap.sh installs it)");
    assert!(
        configure.status.success(),
        "cmake configure:\n{}{}",
        String::from_utf8_lossy(&configure.stdout),
        String::from_utf8_lossy(&configure.stderr)
    );
    let b = Command::new("cmake")
        .arg("--build")
        .arg(&build)
        .output()
        .unwrap();
    assert!(
        b.status.success(),
        "cmake build:\n{}{}",
        String::from_utf8_lossy(&b.stdout),
        String::from_utf8_lossy(&b.stderr)
    );
    build.join("engine_gate")
}

/// Runs the gate (`wrap`: a command it runs under, e.g. valgrind); its stdout, or a
/// panic with everything it and moongate said.
fn gate(exe: &[&std::ffi::OsStr], args: &[&str], mg: &Moongate) -> String {
    let o = Command::new(exe[0])
        .args(&exe[1..])
        .args(args)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "engine_gate {args:?}: {}\n{out}{}\n--- moongate ---\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr),
        mg.proc.log_text()
    );
    out
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in {out}"))
}

/// The seed use case from a native engine: store a prompt prefix's KV blocks, exit,
/// start again, find the prefix, load the blocks byte-identical into registered memory,
/// and produce the same output as from scratch; a partly stored prefix hits only its
/// stored part. Once more with the gate built with AddressSanitizer, and once under
/// valgrind's memcheck (which sees the Rust library too: stable Rust has no sanitizers).
#[test]
fn the_cpp_engine_gate_finds_its_prefix_after_a_restart() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) = kv_unix_moongate(&master, dir.path(), 67108864, "");
    build_library();
    let exe = build_gate(dir.path(), false);
    let asan = build_gate(dir.path(), true);
    let address = format!("unix:{}", sock.display());
    let run = |bin: &[&std::ffi::OsStr], args: &[&str]| {
        let mut all = vec![address.as_str()];
        all.extend_from_slice(args);
        gate(bin, &all, &mg)
    };
    let plain = [exe.as_os_str()];
    let stored = run(&plain, &["store", "7", "32"]);
    let scratch = line(&stored, "output ").to_string();
    // A new process: the engine restarted.
    let loaded = run(&plain, &["load", "7", "32"]);
    assert_eq!(line(&loaded, "hits "), "32/32", "{loaded}");
    assert!(loaded.contains("bytes identical"), "{loaded}");
    assert_eq!(line(&loaded, "output "), scratch, "output with the cache");
    // Half a prefix stored: the rest is computed, the output is the same.
    run(&plain, &["store", "9", "8"]);
    let half = run(&plain, &["load", "9", "16"]);
    // (The gate itself fails unless its output with the loaded blocks equals the one
    // from scratch.)
    assert_eq!(line(&half, "hits "), "8/16", "{half}");
    assert!(half.contains("bytes identical"), "{half}");
    let cold = run(&plain, &["load", "10", "4"]);
    assert_eq!(line(&cold, "hits "), "0/4", "{cold}");
    // AddressSanitizer on the engine's side of the boundary.
    let loaded = run(&[asan.as_os_str()], &["load", "7", "32"]);
    assert_eq!(line(&loaded, "output "), scratch);
    // memcheck on both sides of it.
    let vg = [
        std::ffi::OsStr::new("valgrind"),
        std::ffi::OsStr::new("--error-exitcode=99"),
        std::ffi::OsStr::new("--quiet"),
        exe.as_os_str(),
    ];
    let loaded = run(&vg, &["load", "7", "32"]);
    assert_eq!(line(&loaded, "output "), scratch);
    // Every shared-memory registration ended with its process.
    wait_for(
        "shared memory released",
        std::time::Duration::from_secs(10),
        &[&mg.proc],
        || metric_value(&mg.metrics(), "moongate_kv_shm_registered_bytes") == 0.0,
    );
}
