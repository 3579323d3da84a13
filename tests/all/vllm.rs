//! Real vLLM (its CPU build, in `.venv-vllm` from `scripts/vllm_env.sh`) with a tiny Llama
//! built by the test (`tests/py/vllm_tiny_model.py`: random seeded weights, a locally
//! trained tokenizer), one prompt per engine process (`tests/py/vllm_connector.py`):
//!
//! - moongate's own connector (`moongate_kv.vllm.MoongateConnector`): one process stores
//!   its prompt's blocks through reservations, a second one takes every full block from
//!   moongate through views, both with the token ids of a run without any connector;
//! - what moongate cannot give is recomputed, never read wrong and never waited on: a
//!   block replaced by a value of another size (a failed load, reported to vLLM), a block
//!   removed (the lookup stops there), moongate stopped (nothing loads);
//! - vLLM's own `MooncakeStoreConnector` through moongate's master face (the drop-in
//!   claim), with a standalone Mooncake owner holding the pool.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::kv_c_abi::lib_dir;
use crate::support::*;

/// One engine start and one 601-token prompt take 4-35 s here; beside two busy processes
/// and another test, minutes. A bound against a hang, not a speed check.
const ENGINE_LIMIT: Duration = Duration::from_secs(600);
const PROMPT_TOKENS: usize = 601;

/// vLLM's Python, with the moongate_kv wheel installed in it (once per test run): the
/// connector runs from the wheel, as a deployment's would.
fn vllm_python() -> PathBuf {
    static READY: OnceLock<PathBuf> = OnceLock::new();
    READY
        .get_or_init(|| {
            let p = repo_root().join(".venv-vllm/bin/python");
            assert!(
                p.exists(),
                "{} missing: scripts/vllm_env.sh installs vLLM (scripts/test.sh runs it)",
                p.display()
            );
            install_wheel(&p);
            p
        })
        .clone()
}

/// A command for vLLM's Python that imports moongate_kv from the installed wheel only:
/// no PYTHONPATH, no MOONGATE_KV_LIB, no Rust on the path.
fn vllm_command() -> Command {
    let mut cmd = Command::new(vllm_python());
    cmd.env_remove("PYTHONPATH")
        .env_remove("MOONGATE_KV_LIB")
        .env("PATH", "/usr/local/bin:/usr/bin:/bin");
    cmd
}

/// The tiny model, built once per test binary run (the same seeded weights each time).
fn tiny_model() -> &'static Path {
    static MODEL: OnceLock<PathBuf> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = lib_dir().join("vllm-tiny-llama");
        if !dir.join("model.safetensors").exists() {
            let o = Command::new(vllm_python())
                .arg(repo_root().join("tests/py/vllm_tiny_model.py"))
                .arg(&dir)
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "building the tiny model:\n{}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        dir
    })
}

/// One engine process; its JSON line. The panic quotes its log and moongate's.
fn run_vllm(dir: &Path, name: &str, args: &[&str], mg: Option<&Moongate>) -> serde_json::Value {
    run_vllm_env(dir, name, args, mg, &[])
}

fn run_vllm_env(
    dir: &Path,
    name: &str,
    args: &[&str],
    mg: Option<&Moongate>,
    envs: &[(&str, &str)],
) -> serde_json::Value {
    let out = dir.join(format!("{name}.json"));
    let log = dir.join(format!("{name}.log"));
    let mut cmd = vllm_command();
    cmd.arg(repo_root().join("tests/py/vllm_connector.py"))
        .args(["--model", tiny_model().to_str().unwrap()])
        .args(["--prompt-tokens", &PROMPT_TOKENS.to_string()])
        .args(args)
        .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        .envs(envs.iter().copied())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().expect("vllm");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if start.elapsed() > ENGINE_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(&out).unwrap_or_default();
    let tail = |p: &Path| {
        let s = std::fs::read_to_string(p).unwrap_or_default();
        let cut = s.len().saturating_sub(8000);
        let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        s[cut..].to_string()
    };
    let mg_log = mg.map(|m| m.proc.log_text()).unwrap_or_default();
    match status {
        Some(st) if st.success() => {}
        other => panic!(
            "vLLM {name}: {other:?} (None: still running after {ENGINE_LIMIT:?})\n{said}\n--- its log ---\n{}\n{mg_log}",
            tail(&log)
        ),
    }
    let line = said.lines().rev().find(|l| l.starts_with('{'));
    serde_json::from_str(line.unwrap_or("")).unwrap_or_else(|e| {
        panic!(
            "vLLM {name}: no JSON line ({e}):\n{said}\n--- its log ---\n{}",
            tail(&log)
        )
    })
}

fn tokens(r: &serde_json::Value) -> Vec<u64> {
    r["tokens"]
        .as_array()
        .expect("token ids")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The token ids of a run without any connector (once per test binary run).
fn plain_tokens() -> &'static Vec<u64> {
    static PLAIN: OnceLock<Vec<u64>> = OnceLock::new();
    PLAIN.get_or_init(|| {
        let dir = tempdir();
        let r = run_vllm(dir.path(), "plain", &["--mode", "plain"], None);
        let t = tokens(&r);
        assert!(t.len() >= 16, "{r}");
        // A model whose every output is one token would hide wrong KV.
        let distinct: std::collections::HashSet<_> = t.iter().collect();
        assert!(
            distinct.len() > 4,
            "the tiny model's output is degenerate: {t:?}"
        );
        t
    })
}

/// moongate with an own segment and the kv face on `DIR/kv.sock`.
fn moongate(master: &Master, dir: &Path) -> (Moongate, String, PathBuf) {
    kv_unix_moongate(master, dir, 256 << 20, "")
}

fn moongate_run(
    dir: &Path,
    name: &str,
    sock: &Path,
    mg: &Moongate,
    extra: &[&str],
) -> serde_json::Value {
    let address = format!("unix:{}", sock.display());
    let mut args = vec!["--mode", "moongate", "--address", &address];
    args.extend_from_slice(extra);
    run_vllm(dir, name, &args, Some(mg))
}

fn stat(r: &serde_json::Value, name: &str) -> u64 {
    r["worker_stats"][name].as_u64().unwrap_or(0)
}

#[test]
fn vllm_loads_its_prefix_through_views_and_stores_through_reservations() {
    let plain = plain_tokens();
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) = moongate(&master, dir.path());
    let views = |m: &Moongate| m.metric("moongate_kv_views_total{place=\"in_place\"}");
    let committed =
        |m: &Moongate| m.metric("moongate_kv_reservations_ended_total{end=\"committed\"}");

    let first = moongate_run(dir.path(), "store", &sock, &mg, &["--events"]);
    let bs = first["block_size"].as_u64().unwrap() as usize;
    let blocks = (PROMPT_TOKENS - 1) / bs; // every full block but one token to compute
    let full = PROMPT_TOKENS / bs;
    assert_eq!(tokens(&first), *plain, "the storing process: {first}");
    assert_eq!(stat(&first, "loaded_blocks"), 0, "{first}");
    assert_eq!(stat(&first, "stored_blocks") as usize, full, "{first}");
    assert_eq!(
        committed(&mg) as usize,
        full,
        "one reservation per full block"
    );
    // KV events: each block stored reported to vLLM as stored in moongate.
    assert_eq!(
        first["events"]["moongate"].as_u64(),
        Some(full as u64),
        "{first}"
    );
    // Hints: the prompt's blocks announced as upcoming when the request came, and as
    // done when it finished (no other request of the engine shared them).
    for kind in ["upcoming", "done"] {
        let n = mg.metric(&format!("moongate_hints_received_total{{kind=\"{kind}\"}}"));
        assert_eq!(n as usize, full, "{kind} hints: {first}");
    }
    let views_before = views(&mg);

    let second = moongate_run(dir.path(), "load", &sock, &mg, &[]);
    assert_eq!(tokens(&second), *plain, "the loading process: {second}");
    assert_eq!(stat(&second, "loaded_blocks") as usize, blocks, "{second}");
    assert_eq!(stat(&second, "load_failed_blocks"), 0, "{second}");
    assert_eq!(
        second["cached_tokens"].as_u64().unwrap() as usize,
        blocks * bs,
        "vLLM counts every loaded block as cached: {second}"
    );
    assert_eq!(
        (views(&mg) - views_before) as usize,
        blocks,
        "one view per block, in place"
    );
    // Nothing stored twice: the second process computed only the last block's tokens.
    assert_eq!(committed(&mg) as usize, full);
}

#[test]
fn vllm_recomputes_what_moongate_cannot_give() {
    let plain = plain_tokens();
    let master = Master::start();
    let dir = tempdir();
    let (mut mg, kv, sock) = moongate(&master, dir.path());
    let keys_file = dir.path().join("keys.txt");
    let first = moongate_run(
        dir.path(),
        "store",
        &sock,
        &mg,
        &["--keys-out", keys_file.to_str().unwrap()],
    );
    assert_eq!(tokens(&first), *plain, "{first}");
    let keys: Vec<String> = std::fs::read_to_string(&keys_file)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let bs = first["block_size"].as_u64().unwrap() as usize;
    assert_eq!(keys.len(), PROMPT_TOKENS / bs);
    // Every key this engine names was stored (the scheme is the connector's own).
    let enc = |k: &str| k.replace('/', "%2F");
    for k in &keys {
        let (st, _) = http_bytes(&kv, "GET", &format!("/v1/kv/{}", enc(k)), b"").unwrap();
        assert_eq!(st, 200, "{k} not stored");
    }
    // Block 3 becomes a value of another size: the lookup finds it, its load fails.
    // Block 9 goes: the lookup stops before it. (A key read within the master's lease,
    // 10 s, cannot be removed yet: retried.)
    let remove = |k: &str| {
        let ok = poll_until(Duration::from_secs(30), || {
            http(&kv, "DELETE", &format!("/v1/kv/{}", enc(k)), b"").is_some_and(|(s, _)| s == 204)
        });
        assert!(ok, "{k} could not be removed\n{}", mg.proc.log_text());
    };
    let (st, block3) = http_bytes(&kv, "GET", &format!("/v1/kv/{}", enc(&keys[3])), b"").unwrap();
    assert_eq!(st, 200);
    remove(&keys[3]);
    let (st, body) = http(
        &kv,
        "PUT",
        &format!("/v1/kv/{}", enc(&keys[3])),
        b"not a block",
    )
    .unwrap();
    assert_eq!(st, 201, "{body}");
    remove(&keys[9]);

    let second = moongate_run(dir.path(), "partial", &sock, &mg, &[]);
    assert_eq!(
        tokens(&second),
        *plain,
        "blocks 3 and 9 recomputed: {second}"
    );
    assert_eq!(stat(&second, "load_failed_blocks"), 1, "{second}");
    assert_eq!(
        stat(&second, "loaded_blocks"),
        8,
        "blocks 0-2 and 4-8: {second}"
    );
    assert_eq!(
        second["cached_tokens"].as_u64().unwrap() as usize,
        9 * bs,
        "the lookup stops at the removed block 9: {second}"
    );
    // Recomputed from block 3 on; stored again: block 9 (the others exist). Not in the
    // step whose load failed: that step computed blocks 4-17 against a block 3 that was
    // never loaded, and vLLM threw them away; so must the pool.
    assert_eq!(stat(&second, "stored_blocks"), 1, "{second}");
    assert!(
        stat(&second, "saves_dropped_after_failed_load") > 0,
        "{second}"
    );
    // Block 3 as it was: a process loading every block, block 9 as the recomputing
    // process stored it, gives the same tokens (a block 9 stored from the failed step
    // would not).
    remove(&keys[3]);
    let (st, body) = http(&kv, "PUT", &format!("/v1/kv/{}", enc(&keys[3])), &block3).unwrap();
    assert_eq!(st, 201, "{body}");
    let whole = moongate_run(dir.path(), "whole", &sock, &mg, &[]);
    assert_eq!(tokens(&whole), *plain, "{whole}");
    assert_eq!(stat(&whole, "loaded_blocks"), 18, "{whole}");

    // moongate gone: nothing loads, nothing hangs, the same answer.
    mg.proc.stop();
    let third = moongate_run(dir.path(), "no-moongate", &sock, &mg, &[]);
    assert_eq!(tokens(&third), *plain, "{third}");
    assert_eq!(third["cached_tokens"].as_u64(), Some(0), "{third}");
    assert_eq!(stat(&third, "stored_blocks"), 0, "{third}");
}

/// Runs tests/py/`script` (in vLLM's environment: it has torch) against a fresh moongate
/// with a socket and an own segment; it must say "all ok".
fn script_against_moongate(script: &str) {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) = moongate(&master, dir.path());
    let o = vllm_command()
        .arg(repo_root().join("tests/py").join(script))
        .args(["--address", &format!("unix:{}", sock.display())])
        .output()
        .unwrap();
    all_ok(script, &o, &mg);
}

/// The connector's data path without vLLM (`moongate_kv.paged`, tests/py/paged_kv.py):
/// every layout vLLM can give a layer, stored from one cache and loaded into other blocks
/// of another, layer by layer; failed blocks reported and left untouched.
#[test]
fn paged_blocks_move_in_every_layout_and_failures_touch_nothing() {
    script_against_moongate("paged_kv.py");
}

/// vLLM's own MooncakeStoreConnector (standalone-store: ranks with no segment, a Mooncake
/// owner holding the pool), every one of them pointed at moongate's master face: the
/// second process takes the prompt's blocks from the pool, same tokens, and moongate
/// decoded every call it saw.
#[test]
fn vllm_mooncake_store_connector_works_through_the_master_face() {
    let plain = plain_tokens();
    let master = Master::start();
    let mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let dir = tempdir();
    let mut owner = Command::new(master_binary().with_file_name("mooncake_client"));
    owner.args([
        "--host=127.0.0.1",
        &format!("--port={}", free_port()),
        &format!("--master_server_address={}", mg.listen),
        &format!("--metadata_server={}", master.metadata),
        "--global_segment_size=256 MB",
        "--protocol=tcp",
        "--logtostderr",
    ]);
    let owner = Proc::spawn("owner", owner, dir.path().join("owner.log"));
    wait_for(
        "the owner's segment mounted through moongate",
        Duration::from_secs(60),
        &[&owner, &mg.proc, &master.proc],
        || {
            http_get(&mg.admin, "/metrics").is_some_and(|(_, m)| {
                sample_of(
                    &m,
                    "moongate_master_requests_total{method=\"MountSegment\"}",
                )
                .is_some_and(|v| v >= 1.0)
            })
        },
    );
    let cfg = dir.path().join("mooncake.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "metadata_server": master.metadata,
            "master_server_address": mg.listen,
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",
            "global_segment_size": 0,
            "local_buffer_size": "256MB",
        })
        .to_string(),
    )
    .unwrap();
    let env = [("MOONCAKE_CONFIG_PATH", cfg.to_str().unwrap())];
    let args = ["--mode", "mooncake"];
    let first = run_vllm_env(dir.path(), "mooncake-store", &args, Some(&mg), &env);
    assert_eq!(tokens(&first), *plain, "{first}");
    let second = run_vllm_env(dir.path(), "mooncake-load", &args, Some(&mg), &env);
    assert_eq!(tokens(&second), *plain, "{second}");
    let cached = second["cached_tokens"].as_u64().unwrap() as usize;
    assert!(
        cached >= PROMPT_TOKENS / 2,
        "the second process took {cached} prompt tokens from the pool: {second}"
    );
    let m = mg.metrics();
    for method in [
        "BatchExistKey",
        "BatchPutStart",
        "BatchPutEnd",
        "BatchGetReplicaList",
    ] {
        let n = metric_value(
            &m,
            &format!("moongate_master_requests_total{{method=\"{method}\"}}"),
        );
        assert!(n >= 1.0, "moongate saw no {method}\n{}", owner.log_text());
    }
    let errors: f64 = m
        .lines()
        .filter(|l| l.starts_with("moongate_master_frame_errors"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(errors, 0.0, "frames moongate could not decode");
}

/// The torch helpers (`moongate_kv.torch`) on CPU tensors, in the same environment
/// (tests/py/torch_helpers.py): groups of 64 KiB to 2 MiB values through one batched
/// copy each, bytes equal; a missing key, a size that differs, a stored key: raised,
/// nothing left held.
#[test]
fn torch_helpers_move_groups_of_block_sized_values() {
    script_against_moongate("torch_helpers.py");
}
