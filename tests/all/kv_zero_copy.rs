//! Zero-copy views and reservations (`kv/api/zero_copy.rs`, docs/kv-api.md "Zero copy")
//! against a real master and moongate: the C library's calls from a C program; the
//! bytes under a view kept while the real Mooncake client force-removes the key and
//! writes over where it was; the master's lease renewed while a view is held; an engine
//! killed holding a view and a reservation; writes through a view faulting the engine,
//! not moongate; leases that expire; values outside the own segment staged; and bad
//! frames of the new ops.

use std::ffi::CString;
use std::process::{Command, Stdio};
use std::time::Duration;

use moongate_kv::capi;

use crate::kv_c_abi::{build_library, compile_c};
use crate::support::*;

/// Builds tests/c/kv_zero_copy.c (static library).
fn program(dir: &std::path::Path) -> std::path::PathBuf {
    build_library();
    compile_c(dir, "kv_zero_copy", true)
}

fn run(exe: &std::path::Path, args: &[&str], mg: &Moongate) -> String {
    let o = Command::new(exe).args(args).output().unwrap();
    all_ok(&format!("kv_zero_copy {args:?}"), &o, mg)
}

fn gauge(mg: &Moongate, name: &str) -> f64 {
    metric_value(&mg.metrics(), name)
}

/// An engine in this process: the C library's handle.
struct Handle(*mut capi::mg_client);

impl Handle {
    fn open(sock: &std::path::Path) -> Handle {
        let a = CString::new(format!("unix:{}", sock.display())).unwrap();
        // SAFETY: a NUL-terminated address.
        let c = unsafe { capi::mg_connect(a.as_ptr()) };
        assert!(!c.is_null(), "mg_connect failed");
        Handle(c)
    }

    fn error(&self) -> String {
        // SAFETY: a live handle; the message is a NUL-terminated string it keeps.
        unsafe { std::ffi::CStr::from_ptr(capi::mg_last_error(self.0)) }
            .to_string_lossy()
            .into_owned()
    }

    /// Stores `value` under `key` through a reservation; the reservation's place.
    fn store(&self, key: &str, value: &[u8]) -> i32 {
        let k = CString::new(key).unwrap();
        let (mut p, mut t) = (std::ptr::null_mut(), 0u64);
        // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
        let rc = unsafe { capi::mg_reserve(self.0, k.as_ptr(), value.len(), &mut p, &mut t) };
        assert!(rc >= 0, "reserve {key}: {rc} {}", self.error());
        // SAFETY: the reservation is writable for its length.
        unsafe { std::ptr::copy_nonoverlapping(value.as_ptr(), p.cast::<u8>(), value.len()) };
        // SAFETY: a live handle.
        let c = unsafe { capi::mg_commit(self.0, t) };
        assert_eq!(c, 0, "commit {key}: {}", self.error());
        rc
    }

    /// Views `key`: (place, bytes as a slice of the mapping, lease).
    fn view(&self, key: &str) -> (i32, &'static [u8], u64) {
        let k = CString::new(key).unwrap();
        let (mut p, mut n, mut lease) = (std::ptr::null(), 0usize, 0u64);
        // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
        let rc = unsafe { capi::mg_view(self.0, k.as_ptr(), &mut p, &mut n, &mut lease) };
        assert!(rc >= 0, "view {key}: {rc} {}", self.error());
        // SAFETY: the view is readable for its length until released (the test reads
        // it only while the lease is held).
        (
            rc,
            unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) },
            lease,
        )
    }

    fn release(&self, lease: u64) -> i32 {
        // SAFETY: a live handle.
        unsafe { capi::mg_release(self.0, lease) }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle, closed once.
        unsafe { capi::mg_close(self.0) };
    }
}

#[test]
fn a_c_program_views_reserves_commits_and_aborts() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) = kv_unix_moongate(&master, dir.path(), 64 << 20, "");
    let exe = program(dir.path());
    let addr = format!("unix:{}", sock.display());
    let said = run(&exe, &["check", &addr, "zc"], &mg);
    assert!(said.contains("batches: ok"), "{said}");
    let m = mg.metrics();
    assert!(
        metric_value(&m, "moongate_kv_views_total{place=\"in_place\"}") >= 10.0,
        "{m}"
    );
    assert!(
        metric_value(
            &m,
            "moongate_kv_reservations_ended_total{end=\"committed\"}"
        ) >= 11.0,
        "{m}"
    );
    assert!(
        metric_value(&m, "moongate_kv_reservations_ended_total{end=\"aborted\"}") >= 1.0,
        "{m}"
    );
    // The program closed its handles holding one lease: released with them.
    wait_for(
        "leases released with the handle",
        Duration::from_secs(10),
        &[&mg.proc],
        || {
            gauge(&mg, "moongate_kv_view_leases") == 0.0
                && gauge(&mg, "moongate_kv_viewed_bytes") == 0.0
                && gauge(&mg, "moongate_kv_reservations") == 0.0
        },
    );
}

/// The master forgets a viewed value under its lease (a forced removal) and hands its
/// memory to new puts: those writes wait for the view, then fail, and the viewed bytes
/// never change; once the view ends, the memory is written again. A put of the viewed
/// key itself is Mooncake's no-op, and an unforced removal is refused while the view
/// renews the master's lease (here 1 s, the view held for 3 s).
#[test]
fn the_bytes_under_a_view_stay_until_it_ends() {
    let master = Master::start_with(MasterOpts {
        extra: vec!["--default_kv_lease_ttl=1000".into()],
        ..MasterOpts::default()
    });
    let dir = tempdir();
    // 16 MiB: the pool's only memory, so every put of the peer lands in it.
    // A long lease: the refused put below is retried by the client for seconds.
    let (mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 16 << 20, "lease_ms = 120000\n");
    let logs = [&master.proc, &mg.proc];
    let mut peer = Background::start_args(
        "steps",
        &mg.listen,
        &master.metadata,
        &["--segment-mib", "0"],
        &logs,
    );
    let h = Handle::open(&sock);
    let original = value_of("v/0", 1 << 20);
    assert_eq!(h.store("v/0", &original), 0, "placed in place");
    let (place, bytes, lease) = h.view("v/0");
    assert_eq!(place, 0);
    assert!(bytes == &original[..]);
    // An unforced removal is refused for as long as the view is held, longer than one
    // master lease (the view was answered from what moongate knew of the key it stored:
    // moongate refuses it itself; a view looked up at the master renews its lease).
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1000));
        let (st, body) = http(&kv, "DELETE", "/v1/kv/v%2F0", b"").unwrap();
        assert_eq!(st, 409, "removed under a view: {body}");
    }
    // A put of the same key: Mooncake's no-op, nothing written.
    let r = peer.step_json(&format!("put v/ 1 {}", 1 << 20));
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    assert!(bytes == &original[..]);
    // Forced: the master frees the range under the lease.
    let r = peer.step_json("forcerm v/ 1");
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    // The master hands the freed range out again first (it reuses what it freed last):
    // the next put's write waits for the view, then fails (the client retries, and is
    // given the same range each time).
    let r = peer.step_json(&format!("put w/ 1 {}", 1 << 20));
    assert_eq!(
        r["bad"].as_array().map_or(0, Vec::len),
        1,
        "a put over the viewed range went through: {r}"
    );
    assert!(
        bytes == &original[..],
        "the bytes under the view changed (first at {:?}): {r}\n{}\n{}",
        bytes.iter().zip(&original).position(|(a, b)| a != b),
        mg.metrics(),
        mg.proc.log_text()
    );
    let m = mg.metrics();
    assert!(
        metric_value(&m, "moongate_kv_fenced_writes_total{result=\"rejected\"}") >= 1.0,
        "{m}"
    );
    assert_eq!(h.release(lease), 0);
    // Released: the range is written again.
    let r = peer.step_json(&format!("put x/ 1 {}", 1 << 20));
    assert_eq!(
        r["bad"],
        serde_json::json!([]),
        "{r}\n{}",
        mg.proc.log_text()
    );
    let r = peer.step_json(&format!("get x/ 1 {}", 1 << 20));
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    peer.end(Duration::from_secs(30));
}

/// An engine killed holding a view and a half-written reservation: both end with its
/// connections; the reservation is revoked (never visible, its key free again).
#[test]
fn an_engine_killed_holding_leases_and_tickets_leaves_nothing_behind() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 32 << 20, "");
    let exe = program(dir.path());
    let addr = format!("unix:{}", sock.display());
    let mut child = Command::new(&exe)
        .args(["hold", &addr, "dead"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(line.starts_with("HELD"), "{line}\n{}", mg.proc.log_text());
    assert_eq!(gauge(&mg, "moongate_kv_view_leases"), 1.0);
    assert_eq!(gauge(&mg, "moongate_kv_reservations"), 1.0);
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for(
        "the dead engine's lease and reservation ended",
        Duration::from_secs(10),
        &[&mg.proc],
        || {
            let m = mg.metrics();
            metric_value(&m, "moongate_kv_view_leases") == 0.0
                && metric_value(&m, "moongate_kv_reservations") == 0.0
                && metric_value(&m, "moongate_kv_reservations_ended_total{end=\"orphaned\"}") == 1.0
        },
    );
    // Nothing half-written is visible, and the key can be stored anew.
    let (st, _) = http(&kv, "GET", "/v1/kv/dead%2Funfinished", b"").unwrap();
    assert_eq!(st, 404);
    wait_for(
        "the revoked key stored anew",
        Duration::from_secs(10),
        &[&mg.proc],
        || http(&kv, "PUT", "/v1/kv/dead%2Funfinished", b"whole").is_some_and(|(st, _)| st == 201),
    );
    // The viewed one is no longer fenced: it can be removed.
    wait_for(
        "the viewed key removable once its master lease ran out",
        Duration::from_secs(20),
        &[&mg.proc],
        || http(&kv, "DELETE", "/v1/kv/dead%2Fviewed", b"").is_some_and(|(st, _)| st == 204),
    );
}

/// Writing through a view faults the engine (the mapping is read-only); moongate and
/// the stored bytes are untouched.
#[test]
fn a_write_through_a_view_faults_the_engine_not_moongate() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 16 << 20, "");
    let exe = program(dir.path());
    let original = value_of("s/0", 100_000);
    let (st, _) = http(&kv, "PUT", "/v1/kv/s%2F0", &original).unwrap();
    assert_eq!(st, 201);
    let addr = format!("unix:{}", sock.display());
    let o = Command::new(&exe)
        .args(["scribble", &addr, "s/0"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("VIEWED"),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !out.contains("WROTE"),
        "a write through a view went through"
    );
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&o.status),
        Some(libc::SIGSEGV),
        "{:?}",
        o.status
    );
    let (st, back) = http_bytes(&kv, "GET", "/v1/kv/s%2F0", b"").unwrap();
    assert_eq!(st, 200);
    assert!(back == original, "the stored bytes changed");
    wait_for(
        "the faulted engine's lease released",
        Duration::from_secs(10),
        &[&mg.proc],
        || gauge(&mg, "moongate_kv_view_leases") == 0.0,
    );
}

/// A lease not released ends at `kv.lease_ms`; releasing it then is an error, and a
/// reservation left alone is revoked.
#[test]
fn leases_and_reservations_expire() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 16 << 20, "lease_ms = 300\n");
    let h = Handle::open(&sock);
    h.store("e/0", b"expiring");
    let (_, _, lease) = h.view("e/0");
    let k = CString::new("e/1").unwrap();
    let (mut p, mut t) = (std::ptr::null_mut(), 0u64);
    // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
    let rc = unsafe { capi::mg_reserve(h.0, k.as_ptr(), 4096, &mut p, &mut t) };
    assert_eq!(rc, 0, "{}", h.error());
    wait_for(
        "the lease and reservation expired",
        Duration::from_secs(10),
        &[&mg.proc],
        || {
            gauge(&mg, "moongate_kv_view_leases") == 0.0
                && gauge(&mg, "moongate_kv_reservations") == 0.0
        },
    );
    assert_eq!(h.release(lease), capi::MG_ERR_NO_LEASE);
    // SAFETY: a live handle.
    assert_eq!(unsafe { capi::mg_commit(h.0, t) }, capi::MG_ERR_NO_LEASE);
    let m = mg.metrics();
    assert_eq!(
        metric_value(&m, "moongate_kv_reservations_ended_total{end=\"expired\"}"),
        1.0,
        "{m}"
    );
    let (st, _) = http(&kv, "GET", "/v1/kv/e%2F1", b"").unwrap();
    assert_eq!(st, 404, "an expired reservation is visible");
}

/// Values in another owner's segment are read into the staging area for a view, and a
/// reservation the master places there is written to staging and sent on at commit;
/// with no staging area both are refused as not local.
#[test]
fn values_elsewhere_are_staged_and_refused_without_staging() {
    let master = Master::start();
    let dir = tempdir();
    // No own segment: every value lives in the Python peer's.
    let sock = dir.path().join("kv.sock");
    let (mg, _kv) = kv_moongate(&master, &format!("unix_path = \"{}\"\n", sock.display()));
    let logs = [&master.proc, &mg.proc];
    let peer = Background::start("kvpeer", &mg.listen, &master.metadata, &logs);
    // Beside it, one without staging: refused as not local, with the reason.
    let (_none, _kv) = kv_moongate(
        &master,
        &format!(
            "unix_path = \"{}\"\nstaging_bytes = 0\n",
            dir.path().join("kv2.sock").display()
        ),
    );
    {
        let h = Handle::open(&dir.path().join("kv2.sock"));
        let k = CString::new("py/small").unwrap();
        let (mut p, mut n, mut lease) = (std::ptr::null(), 0usize, 0u64);
        // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
        let rc = unsafe { capi::mg_view(h.0, k.as_ptr(), &mut p, &mut n, &mut lease) };
        assert_eq!(rc, capi::MG_ERR_NOT_LOCAL, "{}", h.error());
        assert!(h.error().contains("kv.staging_bytes"), "{}", h.error());
    }
    let h = Handle::open(&sock);
    let (place, bytes, lease) = h.view("py/big");
    assert_eq!(place, capi::MG_STAGED);
    assert!(
        bytes == &value_of("py/big", (3 << 20) + 7)[..],
        "staged bytes"
    );
    assert_eq!(
        gauge(&mg, "moongate_kv_staging_bytes"),
        ((3u64 << 20) + 4096) as f64
    );
    assert_eq!(h.release(lease), 0);
    assert_eq!(gauge(&mg, "moongate_kv_staging_bytes"), 0.0);
    // A reservation placed in the peer's segment: staged, sent on at commit.
    let small = value_of("kv/small", 5000);
    assert_eq!(h.store("kv/small", &small), capi::MG_STAGED);
    let big = value_of("kv/big", (3 << 20) + 7);
    assert_eq!(h.store("kv/big", &big), capi::MG_STAGED);
    // The peer reads both from its own segment, byte-exact.
    let r = peer.finish();
    for name in ["get kv/small", "get kv/big"] {
        assert_eq!(result(&r, name)["ok"], true, "{name}: {r}");
    }
    drop(h);
}

/// Views and reservations off (`kv.zero_copy = false`): refused as not local, and the
/// copying calls work as before.
#[test]
fn with_zero_copy_off_views_are_refused_and_copies_still_work() {
    let master = Master::start();
    let dir = tempdir();
    let (_mg, _kv, sock) = kv_unix_moongate(&master, dir.path(), 16 << 20, "zero_copy = false\n");
    let h = Handle::open(&sock);
    let k = CString::new("off/0").unwrap();
    let v = b"copied";
    // SAFETY: live handle, key and value.
    assert_eq!(
        unsafe { capi::mg_put(h.0, k.as_ptr(), v.as_ptr().cast(), v.len()) },
        0
    );
    let (mut p, mut n, mut lease) = (std::ptr::null(), 0usize, 0u64);
    // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
    let rc = unsafe { capi::mg_view(h.0, k.as_ptr(), &mut p, &mut n, &mut lease) };
    assert_eq!(rc, capi::MG_ERR_NOT_LOCAL, "{}", h.error());
    let mut back = [0u8; 16];
    // SAFETY: live handle; a buffer of 16 bytes.
    let got = unsafe { capi::mg_get_into(h.0, k.as_ptr(), back.as_mut_ptr().cast(), 16) };
    assert_eq!(got, 6);
}

/// The wheel (`scripts/wheel.sh`) in a fresh virtualenv, used as a user would: no Rust
/// on the path, no MOONGATE_KV_LIB, no PYTHONPATH, away from the repository. It finds
/// its own library, says the workspace's version, carries the C header, imports without
/// torch, and views, reserves and copies against a live moongate (tests/py/kv_python.py).
#[test]
fn the_wheel_alone_in_a_fresh_virtualenv_views_reserves_and_copies() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) = kv_unix_moongate(&master, dir.path(), 64 << 20, "");
    let venv = dir.path().join("venv");
    let o = Command::new(python())
        .args(["-m", "venv"])
        .arg(&venv)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let py = venv.join("bin/python");
    // Installable where vLLM runs (glibc 2.28 and later), whatever glibc built it.
    let name = wheel().file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.contains("-cp39-abi3-manylinux_2_28_x86_64"),
        "the wheel's tags: {name}"
    );
    install_wheel(&py);
    let o = installed_python(&py)
        .arg(repo_root().join("tests/py/kv_python.py"))
        .args(["--address", &format!("unix:{}", sock.display())])
        .current_dir(dir.path())
        .output()
        .unwrap();
    all_ok("kv_python.py from the wheel", &o, &mg);
    let o = installed_python(&py)
        .args([
            "-c",
            "import os, sys, importlib.metadata as m, moongate_kv as k\n\
             assert 'torch' not in sys.modules\n\
             here = os.path.dirname(k.__file__)\n\
             assert k.library_path().startswith(here), k.library_path()\n\
             assert os.path.exists(os.path.join(here, 'include', 'moongate_kv.h'))\n\
             assert k.__version__ == m.version('moongate-kv'), (k.__version__, m.version('moongate-kv'))\n\
             print(k.__version__)",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        workspace_version(),
        "one version for the wheel, the library and moongate"
    );
}

/// Malformed view, release, reserve, commit and hello frames: each gets its error on the
/// connection, which stays usable; nothing else is affected.
#[test]
fn bad_zero_copy_frames_get_errors_and_the_connection_carries_on() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 16 << 20, "max_batch_keys = 8\n");
    let mut raw = crate::kv_shm::Raw::open(&sock);
    let n = |v: u32| v.to_le_bytes().to_vec();
    let key = |k: &str| {
        let mut b = (k.len() as u16).to_le_bytes().to_vec();
        b.extend_from_slice(k.as_bytes());
        b
    };
    let cases: Vec<(&str, u8, Vec<u8>, i32)> = vec![
        (
            "view: more keys than kv.max_batch_keys",
            9,
            n(9),
            capi::MG_ERR_ARG,
        ),
        (
            "view: a key longer than its frame",
            9,
            [n(1), vec![200, 0, b'a']].concat(),
            capi::MG_ERR_ARG,
        ),
        (
            "view: an empty key",
            9,
            [n(1), key("")].concat(),
            capi::MG_ERR_ARG,
        ),
        (
            "view: bytes after the last key",
            9,
            [n(1), key("a"), vec![1]].concat(),
            capi::MG_ERR_ARG,
        ),
        ("release: short", 10, vec![1, 2], capi::MG_ERR_ARG),
        (
            "release: unknown lease",
            10,
            42u64.to_le_bytes().to_vec(),
            capi::MG_ERR_NO_LEASE,
        ),
        (
            "reserve: 0 bytes",
            11,
            [n(1), 0u64.to_le_bytes().to_vec(), key("z")].concat(),
            capi::MG_ERR_ARG,
        ),
        (
            "reserve: over max_value_bytes",
            11,
            [n(1), u64::MAX.to_le_bytes().to_vec(), key("z")].concat(),
            capi::MG_ERR_ARG,
        ),
        (
            "reserve: truncated",
            11,
            [n(2), 8u64.to_le_bytes().to_vec(), key("z")].concat(),
            capi::MG_ERR_ARG,
        ),
        (
            "commit: truncated",
            12,
            [n(2), 1u64.to_le_bytes().to_vec()].concat(),
            capi::MG_ERR_ARG,
        ),
        ("hello: short", 7, vec![1], capi::MG_ERR_ARG),
    ];
    for (what, op, body, want) in cases {
        let (st, msg) = raw.call(op, &body, None);
        assert_eq!(st, want, "{what}: {}", String::from_utf8_lossy(&msg));
    }
    // An unknown ticket per item; a second hello on the same connection.
    let (st, body) = raw.call(12, &[n(1), 7u64.to_le_bytes().to_vec()].concat(), None);
    assert_eq!(
        (st, body),
        (0, capi::MG_ERR_NO_LEASE.to_le_bytes().to_vec())
    );
    let (st, _) = raw.call(7, &5u64.to_le_bytes(), None);
    assert_eq!(st, 0);
    let (st, _) = raw.call(7, &5u64.to_le_bytes(), None);
    assert_eq!(st, capi::MG_ERR_ARG, "a second hello");
    // Still serving: a view of a missing key on this connection, HTTP beside it.
    let (st, body) = raw.call(9, &[n(1), key("missing")].concat(), None);
    assert_eq!(st, 0);
    assert_eq!(&body[8..12], &capi::MG_ERR_NOT_FOUND.to_le_bytes());
    let (st, _) = http(&kv, "PUT", "/v1/kv/after", b"fine").unwrap();
    assert_eq!(st, 201, "{}", mg.proc.log_text());
}

/// A view through the replica cache is checked against the writes since its entry was
/// looked up: a client that goes to the master directly (no moongate sees its removal)
/// force-removes a cached key and puts another value into its range; the view of the
/// removed key then asks the master again and finds it gone, instead of answering the
/// other value's bytes as the removed key's.
#[test]
fn a_cached_view_of_a_range_written_since_asks_the_master_again() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, sock) =
        kv_unix_moongate(&master, dir.path(), 16 << 20, "replica_cache_ms = 60000\n");
    let logs = [&master.proc, &mg.proc];
    // Straight to the master: moongate relays none of its calls.
    let mut peer = Background::start_args(
        "steps",
        &master.rpc,
        &master.metadata,
        &["--segment-mib", "0"],
        &logs,
    );
    let h = Handle::open(&sock);
    let original = value_of("c/0", 1 << 20);
    h.store("c/0", &original);
    // A read fills the replica cache.
    let (st, _) = http_bytes(&kv, "GET", "/v1/kv/c%2F0", b"").unwrap();
    assert_eq!(st, 200);
    // Past the read lease (10 s on the master by default), the key is force-removed and
    // another value takes its range (the master reuses what it freed last).
    std::thread::sleep(Duration::from_millis(200));
    let r = peer.step_json("forcerm c/ 1");
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    let r = peer.step_json(&format!("put d/ 1 {}", 1 << 20));
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    let k = CString::new("c/0").unwrap();
    let (mut p, mut n, mut lease) = (std::ptr::null(), 0usize, 0u64);
    // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
    let rc = unsafe { capi::mg_view(h.0, k.as_ptr(), &mut p, &mut n, &mut lease) };
    assert_eq!(rc, capi::MG_ERR_NOT_FOUND, "{}", h.error());
    peer.end(Duration::from_secs(30));
}

/// A value an engine stored in moongate's segment is viewed without a master call
/// (`kv.known_keys`), and stops being so the moment anything could have changed it: a
/// removal through the kv face or the master face (unforced too), or a write over its
/// range by a client that removed it straight at the master. A DELETE while such a view
/// is held is refused (it holds no master lease). Releases sent ahead of their answers
/// (`mg_release_later`) end the lease before the next call.
#[test]
fn a_value_moongate_stored_is_viewed_without_the_master_until_anything_touches_it() {
    known_keys_case(true);
}

/// The same with `kv.known_keys = 0`: every view asks the master (the counter stays 0;
/// the removals that follow in the case above need the master's read lease gone).
#[test]
fn with_known_keys_off_every_view_asks_the_master() {
    known_keys_case(false);
}

fn known_keys_case(on: bool) {
    let master = Master::start();
    let dir = tempdir();
    let extra = if on { "" } else { "known_keys = 0\n" };
    let (mg, kv, sock) = kv_unix_moongate(&master, dir.path(), 16 << 20, extra);
    let logs = [&master.proc, &mg.proc];
    let h = Handle::open(&sock);
    let known = || gauge(&mg, "moongate_kv_views_known_total");
    // Stored, then viewed twice: from what moongate knows, or from the master.
    let a = value_of("k/0", 1 << 20);
    assert_eq!(h.store("k/0", &a), 0);
    for _ in 0..2 {
        let (place, bytes, lease) = h.view("k/0");
        assert_eq!(place, 0);
        assert!(bytes == &a[..]);
        // SAFETY: a live handle.
        assert_eq!(unsafe { capi::mg_release_later(h.0, lease) }, 0);
    }
    assert_eq!(known(), if on { 2.0 } else { 0.0 }, "{}", mg.metrics());
    // A release sent ahead ended its lease before the next call was answered.
    assert_eq!(gauge(&mg, "moongate_kv_view_leases"), 0.0);
    // One moongate no longer holds is not reported, and the connection carries on.
    // SAFETY: a live handle.
    assert_eq!(unsafe { capi::mg_release_later(h.0, 987_654_321) }, 0);
    let (_, bytes, lease) = h.view("k/0");
    assert!(bytes == &a[..]);
    // Under that view, a DELETE is refused (with known keys off, by the master's lease).
    let (st, body) = http(&kv, "DELETE", "/v1/kv/k%2F0", b"").unwrap();
    assert_eq!(st, 409, "removed under a view: {body}");
    assert_eq!(h.release(lease), 0);
    if !on {
        // The master's read lease from the lookup outlives the view (Mooncake's
        // --default_kv_lease_ttl): what follows needs removals right after a view.
        return;
    }
    // Removed through the kv face at once (a view answered from what moongate knew took
    // no master lease): not found, not answered from what moongate knew.
    let (st, body) = http(&kv, "DELETE", "/v1/kv/k%2F0", b"").unwrap();
    assert_eq!(st, 204, "{body}");
    let not_found = |key: &str| {
        let k = CString::new(key).unwrap();
        let (mut p, mut n, mut lease) = (std::ptr::null(), 0usize, 0u64);
        // SAFETY: live handle, NUL-terminated key, out-pointers to locals.
        let rc = unsafe { capi::mg_view(h.0, k.as_ptr(), &mut p, &mut n, &mut lease) };
        rc == capi::MG_ERR_NOT_FOUND
    };
    assert!(not_found("k/0"), "{}", h.error());
    // Removed (unforced) by a Mooncake client through the master face.
    let b = value_of("m/0", 1 << 20);
    assert_eq!(h.store("m/0", &b), 0);
    let mut via = Background::start_args(
        "steps",
        &mg.listen,
        &master.metadata,
        &["--segment-mib", "0"],
        &logs,
    );
    let r = via.step_json("rm m/ 1");
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    assert!(not_found("m/0"), "{}", h.error());
    via.end(Duration::from_secs(30));
    // Removed straight at the master (moongate hears nothing), and its range written
    // again by a put: the write passed through moongate, which forgot the key.
    let c = value_of("s/0", 1 << 20);
    assert_eq!(h.store("s/0", &c), 0);
    let before = known();
    let (_, _, lease) = h.view("s/0");
    assert_eq!(h.release(lease), 0);
    assert_eq!(known(), before + 1.0);
    let mut direct = Background::start_args(
        "steps",
        &master.rpc,
        &master.metadata,
        &["--segment-mib", "0"],
        &logs,
    );
    let r = direct.step_json("forcerm s/ 1");
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    let r = direct.step_json(&format!("put t/ 1 {}", 1 << 20));
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    assert!(not_found("s/0"), "{}", h.error());
    let r = direct.step_json(&format!("get t/ 1 {}", 1 << 20));
    assert_eq!(r["bad"], serde_json::json!([]), "{r}");
    direct.end(Duration::from_secs(30));
}

/// The own segment's pages are made at start (`kv.prefault`), unless the segment is
/// larger than the memory the host has free: an oversubscribed segment is left to fill
/// as it is written, and works all the same.
#[test]
fn the_segment_is_prefaulted_unless_it_cannot_fit() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, _sock) = kv_unix_moongate(&master, dir.path(), 64 << 20, "");
    wait_for(
        "the own segment prefaulted",
        Duration::from_secs(30),
        &[&mg.proc],
        || mg.proc.log_text().contains("own segment prefaulted"),
    );
    drop(mg);
    // Four times the host's memory: never made whole.
    let total = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap()
        * 1024;
    let dir2 = tempdir();
    let (big, _kv, sock) = kv_unix_moongate(&master, dir2.path(), 4 * total, "");
    wait_for(
        "the prefault skipped",
        Duration::from_secs(30),
        &[&big.proc],
        || big.proc.log_text().contains("own segment not prefaulted"),
    );
    let h = Handle::open(&sock);
    let v = value_of("o/0", 1 << 20);
    assert_eq!(h.store("o/0", &v), 0);
    let (_, bytes, lease) = h.view("o/0");
    assert!(bytes == &v[..]);
    assert_eq!(h.release(lease), 0);
}
