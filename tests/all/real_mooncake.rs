//! The real Mooncake Python client through moongate behaves exactly as against the real
//! master: same results for every call, byte-exact data, the transfer-engine TCP path
//! between two client processes, and a heartbeat that keeps an idle client mounted.

use crate::support::*;
use serde_json::Value;

/// Owner + reader against `master_addr` (the master itself or moongate in front of it).
fn two_process_scenario(master_addr: &str, metadata: &str, logs: &[&Proc]) -> (Value, Value) {
    scenario_on(None, master_addr, metadata, logs)
}

/// [`two_process_scenario`] with the clients of `release` (`None`: the pinned one).
pub(crate) fn scenario_on(
    release: Option<&Release>,
    master_addr: &str,
    metadata: &str,
    logs: &[&Proc],
) -> (Value, Value) {
    let owner = Background::start_on(release, "owner", master_addr, metadata, &[], logs);
    let reader = run_role_on(
        release,
        "reader",
        master_addr,
        metadata,
        &["--owner-host", owner.endpoint()],
        logs,
    );
    let owner_res = owner.finish();
    (owner_res, reader)
}

/// The master-face decode-error samples of a metrics page that are not 0.
pub(crate) fn decode_errors(metrics: &str) -> Vec<&str> {
    metrics
        .lines()
        .filter(|l| l.contains("kind=\"decode\"}") && !l.ends_with(" 0"))
        .collect()
}

pub(crate) fn assert_all_data_ok(v: &Value) {
    // every {"ok": ...} in the results must be true (byte-for-byte checks)
    match v {
        Value::Object(m) => {
            if let Some(ok) = m.get("ok") {
                match ok {
                    Value::Bool(b) => assert!(b, "data mismatch in {v}"),
                    Value::Array(a) => assert!(a.iter().all(|x| x == &Value::Bool(true)), "{v}"),
                    _ => {}
                }
            }
            m.values().for_each(assert_all_data_ok);
        }
        Value::Array(a) => a.iter().for_each(assert_all_data_ok),
        _ => {}
    }
}

#[test]
fn every_call_matches_the_direct_run() {
    let direct_master = Master::start();
    let direct = two_process_scenario(
        &direct_master.rpc,
        &direct_master.metadata,
        &[&direct_master.proc],
    );
    assert_all_data_ok(&direct.0);
    assert_all_data_ok(&direct.1);
    drop(direct_master);

    for reencode in ["on-change", "always"] {
        let master = Master::start();
        let mg = Moongate::start_with(&master.rpc, &format!("reencode = \"{reencode}\""));
        mg.wait_ready(&master);
        let via = two_process_scenario(&mg.listen, &master.metadata, &[&master.proc, &mg.proc]);
        assert_eq!(
            via.1, direct.1,
            "reader results differ (reencode={reencode})"
        );
        assert_eq!(
            via.0, direct.0,
            "owner results differ (reencode={reencode})"
        );

        let m = mg.metrics();
        for method in [
            "ServiceReady",
            "MountSegment",
            "PutStart",
            "PutEnd",
            "BatchPutStart",
            "BatchPutEnd",
            "GetReplicaList",
            "BatchGetReplicaList",
            "ExistKey",
            "BatchExistKey",
            "UpsertStart",
            "UpsertEnd",
            "Remove",
            "RemoveAll",
            "UnmountSegment",
            "Ping",
        ] {
            let n = metric_value(
                &m,
                &format!("moongate_master_requests_total{{method=\"{method}\"}}"),
            );
            assert!(n >= 1.0, "{method} not counted\n{m}");
        }
        for kind in ["decode", "rpc"] {
            let bad: f64 = m
                .lines()
                .filter(|l| {
                    l.starts_with("moongate_master_errors_total")
                        && l.contains(&format!("kind=\"{kind}\""))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            assert_eq!(
                bad,
                0.0,
                "{kind} errors on clean traffic\n{m}\n{}",
                mg.proc.log_text()
            );
        }
        // The scenario's misses and the leased remove are application errors.
        assert!(
            metric_value(
                &m,
                "moongate_master_errors_total{method=\"Remove\",kind=\"app\"}"
            ) >= 1.0
        );
        assert!(
            metric_value(
                &m,
                "moongate_master_request_duration_seconds_count{method=\"GetReplicaList\"}"
            ) >= 1.0
        );
        assert_eq!(metric_value(&m, "moongate_upstream_ready"), 1.0);
    }
}

#[test]
fn idle_client_stays_mounted_behind_moongate() {
    let master = Master::start();
    let mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let r = run_role(
        "idle",
        &mg.listen,
        &master.metadata,
        &["--idle", "20"],
        &[&master.proc, &mg.proc],
    );
    if r.to_string().contains("\"ok\":false") {
        panic!(
            "the idle client lost its data: {r}\n--- moongate ---\n{}\n--- master ---\n{}",
            mg.proc.log_text(),
            master.proc.log_text()
        );
    }
    assert_all_data_ok(&r);
    let ops: Vec<&Value> = r.as_array().unwrap().iter().collect();
    let get = |name: &str| ops.iter().find(|o| o[0] == name).map(|o| o[1].clone());
    assert_eq!(get("is_exist"), Some(Value::from(1)), "{r}");
    assert_eq!(get("put after idle"), Some(Value::from(0)), "{r}");
    assert_eq!(get("close"), Some(Value::from(0)), "{r}");
    // The master's client TTL is 10 s: only heartbeats that got through keep the segment.
    let pings = mg.metric("moongate_master_requests_total{method=\"Ping\"}");
    assert!(pings >= 15.0, "only {pings} pings in 20 s");
    assert_eq!(
        mg.metric("moongate_master_errors_total{method=\"Ping\",kind=\"app\"}"),
        0.0
    );
}

#[test]
fn tier_metrics_count_real_disk_replicas_at_no_extra_rpc() {
    let root = tempdir();
    let master = Master::start_with(MasterOpts {
        root_fs_dir: Some(root.path().to_path_buf()),
        ..Default::default()
    });
    let mg = Moongate::start(&master.rpc);
    mg.wait_ready(&master);
    let r = run_role(
        "disk",
        &mg.listen,
        &master.metadata,
        &[],
        &[&master.proc, &mg.proc],
    );
    assert_all_data_ok(&r);
    let ops: Vec<&Value> = r.as_array().unwrap().iter().collect();
    let get = |name: &str| {
        ops.iter()
            .find(|o| o[0] == name)
            .map(|o| o[1].clone())
            .unwrap()
    };
    assert_eq!(get("tiers"), serde_json::json!(["disk", "memory"]), "{r}");
    assert_eq!(get("is_exist"), serde_json::json!([1, 0]));
    let m = mg.metrics();
    let v = |s: &str| metric_value(&m, s);
    let lookups = v("moongate_master_requests_total{method=\"GetReplicaList\"}");
    // No extra RPC: the master counted exactly the calls the client sent through
    // moongate (tier accounting reads the answers it relays, it asks nothing), and the
    // one release probe (a GetReplicaList) per upstream connection.
    let mm = master.metrics();
    let probes = v("moongate_master_release_probes_total");
    assert!(probes >= 1.0, "{m}");
    for (ours, theirs) in [
        ("GetReplicaList", "master_get_replica_list_requests_total"),
        ("ExistKey", "master_exist_key_requests_total"),
        ("PutStart", "master_put_start_requests_total"),
        ("PutEnd", "master_put_end_requests_total"),
    ] {
        let relayed = v(&format!(
            "moongate_master_requests_total{{method=\"{ours}\"}}"
        ));
        assert!(relayed >= 1.0, "{ours} was exercised");
        let probed = if ours == "GetReplicaList" {
            probes
        } else {
            0.0
        };
        assert_eq!(
            relayed + probed,
            metric_value(&mm, theirs),
            "{ours}: master saw other calls\n{mm}"
        );
    }
    assert!(
        v("moongate_tier_keys_total{tier=\"disk\",outcome=\"found\",arm=\"default\"}") >= 1.0,
        "{m}"
    );
    assert_eq!(
        v("moongate_tier_bytes_total{tier=\"disk\",outcome=\"found\",arm=\"default\"}")
            / v("moongate_tier_keys_total{tier=\"disk\",outcome=\"found\",arm=\"default\"}"),
        2000.0
    );
    // every found lookup saw the memory replica; the miss is not_found
    let found_mem =
        v("moongate_tier_keys_total{tier=\"memory\",outcome=\"found\",arm=\"default\"}");
    let missing =
        v("moongate_tier_keys_total{tier=\"unknown\",outcome=\"not_found\",arm=\"default\"}");
    assert_eq!(
        found_mem + missing,
        lookups,
        "one tally per looked-up key\n{m}"
    );
    assert!(missing >= 1.0);
    assert_eq!(
        v("moongate_lookup_keys_total{result=\"hit\",arm=\"default\"}"),
        1.0
    );
    assert_eq!(
        v("moongate_lookup_keys_total{result=\"miss\",arm=\"default\"}"),
        1.0
    );
}

/// 5,000-key batches from the real client, split into parts of at most 1,000 keys, give
/// the same results as the unsplit calls to the master, while a second client keeps
/// heartbeating and calling on its own connections.
#[test]
fn split_batches_answer_like_the_unsplit_master() {
    let args = ["--count", "5000", "--prefix", "bulk/"];
    let direct_master = Master::start();
    let direct = run_role(
        "bulk",
        &direct_master.rpc,
        &direct_master.metadata,
        &args,
        &[&direct_master.proc],
    );
    drop(direct_master);
    let ops: Vec<&Value> = direct.as_array().unwrap().iter().collect();
    let get = |name: &str| ops.iter().find(|o| o[0] == name).map(|o| o[1].clone());
    assert_eq!(get("put_batch"), Some(Value::from(0)), "{direct}");
    assert_eq!(
        get("get_batch"),
        Some(serde_json::json!({"n": 5000, "ok": 5000})),
        "the direct run itself must read everything back: {direct}"
    );

    let master = Master::start();
    let mg = Moongate::start_with(&master.rpc, "max_batch_keys = 1000");
    mg.wait_ready(&master);
    let logs = [&master.proc, &mg.proc];
    // A neighbour at a steady pace (a spinning one starves the other tests' clients of
    // CPU on a 2-core CI machine).
    let neighbour = Background::start_args(
        "loop",
        &mg.listen,
        &master.metadata,
        &["--pause-ms", "5"],
        &logs,
    );
    let via = run_role("bulk", &mg.listen, &master.metadata, &args, &logs);
    // The neighbour's own calls all succeeded meanwhile.
    let loop_res = neighbour.finish();
    assert_eq!(
        result(&loop_res, "failures"),
        &Value::from(Vec::<Value>::new())
    );
    assert!(
        result(&loop_res, "iterations").as_u64().unwrap() > 0,
        "{loop_res}"
    );
    assert_eq!(via, direct, "results through split batches differ");

    let m = mg.metrics();
    let v = |s: &str| metric_value(&m, s);
    // put_batch = BatchPutStart + BatchPutEnd; batch_is_exist holds 10,000 keys.
    for (method, parts) in [
        ("BatchPutStart", 5.0),
        ("BatchPutEnd", 5.0),
        ("BatchExistKey", 10.0),
    ] {
        assert!(
            v(&format!(
                "moongate_batch_splits_total{{method=\"{method}\"}}"
            )) >= 1.0,
            "{method} not split\n{m}"
        );
        assert!(
            v(&format!(
                "moongate_batch_parts_total{{method=\"{method}\"}}"
            )) >= parts,
            "{method}\n{m}"
        );
    }
    assert!(v("moongate_batch_splits_total{method=\"BatchGetReplicaList\"}") >= 1.0);
    assert_eq!(
        v("moongate_master_errors_total{method=\"Ping\",kind=\"app\"}"),
        0.0
    );
    for kind in ["rpc", "decode"] {
        for method in [
            "BatchPutStart",
            "BatchPutEnd",
            "BatchExistKey",
            "BatchGetReplicaList",
        ] {
            assert_eq!(
                v(&format!(
                    "moongate_master_errors_total{{method=\"{method}\",kind=\"{kind}\"}}"
                )),
                0.0,
                "{method} {kind}\n{m}"
            );
        }
    }
}
