//! A fleet of moongates on one pool, through a real etcd (Debian's etcd-server): members
//! see each other and lose a dead one with its lease; their evictors free the pool's
//! excess once between them, each from its own keys.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::*;

fn fleet_config(upstream: &str, etcd: &str, cluster: &str, member: &str, extra: &str) -> String {
    format!(
        "[master_face]\nupstream = \"{upstream}\"\n{extra}\n\
         [fleet]\nenabled = true\netcd = \"{etcd}\"\ncluster = \"{cluster}\"\n\
         member = \"{member}\"\ninterval_ms = 200\nlease_ttl_s = 2\n"
    )
}

fn fleet(mg: &Moongate) -> Value {
    match http_get(&mg.admin, "/fleet") {
        Some((200, b)) => serde_json::from_str(&b).unwrap(),
        other => panic!("GET /fleet: {other:?}\n{}", mg.proc.log_text()),
    }
}

fn members(mg: &Moongate) -> Vec<String> {
    fleet(mg)["members"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["member"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Member `name` of cluster "t", with `extra` before its `[fleet]` section and
/// `fleet_extra` inside it.
fn member(master: &Master, etcd: &Etcd, name: &str, extra: &str, fleet_extra: &str) -> Moongate {
    let cfg = fleet_config(&master.rpc, &etcd.endpoint, "t", name, extra);
    Moongate::start_config(&format!("{cfg}{fleet_extra}"))
}

/// Members "a" and "b" with `extra`, ready and seeing each other.
fn pair(master: &Master, etcd: &Etcd, extra: &str) -> (Moongate, Moongate) {
    let m = |n: &str| member(master, etcd, n, extra, "");
    pair_of(master, etcd, m("a"), m("b"))
}

fn pair_of(master: &Master, etcd: &Etcd, a: Moongate, b: Moongate) -> (Moongate, Moongate) {
    a.wait_ready(master);
    b.wait_ready(master);
    let logs = [&master.proc, &a.proc, &b.proc, &etcd.proc];
    wait_for("both members", Duration::from_secs(20), &logs, || {
        members(&a).len() == 2 && members(&b).len() == 2
    });
    (a, b)
}

/// The master's allocated bytes (the pool's usage).
fn allocated(master: &Master) -> u64 {
    sample_of(&master.metrics(), "master_allocated_bytes").unwrap_or(f64::MAX) as u64
}

/// Waits for the fleet's evictors to bring the pool down to `bytes` or below.
fn down_to(master: &Master, bytes: u64, logs: &[&Proc]) {
    wait_for(
        "the pool down to the low watermark",
        Duration::from_secs(30),
        logs,
        || allocated(master) <= bytes,
    );
}

#[test]
fn members_see_each_other_and_a_dead_one_leaves_with_its_lease() {
    let etcd = Etcd::start();
    let master = Master::start();
    let start = |cluster: &str, m: &str| {
        Moongate::start_config(&fleet_config(&master.rpc, &etcd.endpoint, cluster, m, ""))
    };
    let mut mgs: Vec<Moongate> = (0..3).map(|i| start("t", &format!("m{i}"))).collect();
    let other = start("other", "x");
    fn logs<'a>(mgs: &'a [Moongate], etcd: &'a Etcd) -> Vec<&'a Proc> {
        let mut l: Vec<&Proc> = mgs.iter().map(|m| &m.proc).collect();
        l.push(&etcd.proc);
        l
    }
    let all = ["m0", "m1", "m2"];
    wait_for(
        "every member sees the three",
        Duration::from_secs(20),
        &logs(&mgs, &etcd),
        || mgs.iter().all(|m| members(m) == all) && members(&other) == ["x"],
    );
    assert_eq!(mgs[0].metric("moongate_fleet_members"), 3.0);
    // The same from etcd alone, as an operator sees it.
    let status = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_moongate"))
            .args(["fleet", "status"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = status(&["--etcd", &etcd.endpoint, "--cluster", "t"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("cluster t: 3 members"), "{text}");
    assert!(
        all.iter().all(|m| text.contains(m)) && !text.contains(" x "),
        "{text}"
    );
    let out = status(&["--etcd", &etcd.endpoint, "--cluster", "t", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["members"].as_array().map(Vec::len), Some(3), "{v}");
    assert_eq!(
        v["control"], "default",
        "the members name their control arm: {v}"
    );
    let out = status(&["--etcd", ""]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--etcd: no endpoint"));
    let rec = &fleet(&mgs[1])["members"][0];
    assert_eq!(
        rec["admin"],
        mgs[0].admin.as_str(),
        "a record names its admin endpoint"
    );

    // A crash: the key goes with its lease (2 s).
    mgs[2].proc.signal(libc::SIGKILL);
    let killed = Instant::now();
    wait_for(
        "the killed member leaves every view",
        Duration::from_secs(15),
        &logs(&mgs[..2], &etcd),
        || mgs[..2].iter().all(|m| members(m) == ["m0", "m1"]),
    );
    let gone_after = killed.elapsed();
    // A clean stop revokes the lease: the others see it go without waiting for it.
    let mut stopped = mgs.remove(1);
    stopped.proc.signal(libc::SIGTERM);
    let _ = stopped.proc.wait_exit(Duration::from_secs(20));
    wait_for(
        "the stopped member leaves",
        Duration::from_secs(15),
        &logs(&mgs[..1], &etcd),
        || members(&mgs[0]) == ["m0"],
    );
    assert_eq!(mgs[0].metric("moongate_fleet_members"), 1.0);
    assert_eq!(mgs[0].metric("moongate_fleet_etcd_errors_total"), 0.0);
    eprintln!("a killed member left the views {gone_after:?} after SIGKILL (lease 2 s)");
}

/// Two members, each beside a client that put through it; together over the high
/// watermark. Each frees its portion of the excess (its bytes over the fleet's), so
/// both remove keys and together they remove what the watermark asked for, once.
#[test]
fn a_fleet_frees_the_pools_excess_once_each_member_its_portion() {
    const KIB64: u64 = 64 << 10;
    let etcd = Etcd::start();
    let master = Master::start();
    let eviction = format!(
        "[eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.3\nlow_watermark = 0.15\ninterval_ms = 200\n",
        master.metrics_url
    );
    let (a, b) = pair(&master, &etcd, &eviction);
    let logs = [&master.proc, &a.proc, &b.proc, &etcd.proc];
    // A: 8 chains (4 MiB) into its 16 MiB segment (0.25: under the watermark alone).
    // B mounts 16 MiB more and puts 12 chains (6 MiB): 10 MiB of 32, 0.31.
    let chains = |mg: &Moongate, count: &str, prefix: &str| {
        let args = ["--count", count, "--prefix", prefix];
        Background::start_args("chains", &mg.listen, &master.metadata, &args, &logs)
    };
    let (ca, cb) = (chains(&a, "8", "a/"), chains(&b, "12", "b/"));
    let total = 20 * 8 * KIB64;
    let capacity = 32u64 << 20;
    let low = (0.15 * capacity as f64) as u64;
    let asked = total - low;
    let allocated = || allocated(&master);
    down_to(&master, low + 2 * KIB64, &logs);
    // What was removed is gone and nothing else (the master evicted nothing itself):
    // once the last removal is answered and counted, the pool holds exactly the bytes
    // not removed. (Checked before the clients close: a closing client unmounts its
    // segment, and the replicas in it go with it.)
    let removed_by = |m: &Moongate| m.metric("moongate_eviction_removed_bytes_total") as u64;
    let (mut removed_a, mut removed_b) = (0, 0);
    wait_for(
        "the pool to hold exactly what was not removed",
        Duration::from_secs(20),
        &logs,
        || {
            (removed_a, removed_b) = (removed_by(&a), removed_by(&b));
            allocated() == total - removed_a - removed_b
        },
    );
    let removed = removed_a + removed_b;
    let detail = format!(
        "asked {asked} B (10 MiB down to 0.15 of 32 MiB); removed {removed} B \
         (a {removed_a}, b {removed_b}); pool now {} B",
        allocated()
    );
    eprintln!("{detail}");
    assert!(
        removed.abs_diff(asked) * 10 <= asked,
        "the fleet removed the excess once, within 10 %: {detail}"
    );
    assert!(
        removed_a > 0 && removed_b > 0,
        "each member freed its portion from its own keys: {detail}"
    );
    assert_eq!(
        sample_of(&master.metrics(), "master_evicted_key_count"),
        Some(0.0),
        "{detail}"
    );
    for c in [ca, cb] {
        let r = c.finish();
        let puts = result(&r, "puts");
        assert!(
            puts.as_array().unwrap().iter().all(|v| *v == 0),
            "every put landed: {puts}"
        );
    }
}

/// What survives when keys put through one member are read through another: with
/// access records the reads reach each key's home, so the fleet's evictors rank keys
/// by every member's accesses; without them the member that put the keys sees them
/// cold and removes them first. Returns the hot keys missing after eviction, the bytes
/// the members removed, and the misses of evicted keys through the reader's member
/// with those the fleet explained as evicted by moongate.
fn hot_keys_after_eviction(records: bool) -> (Vec<u64>, u64, usize, f64) {
    const KIB256: u64 = 256 << 10;
    let etcd = Etcd::start();
    let master = Master::start_with(MasterOpts {
        extra: vec!["--default_kv_lease_ttl=500".into()],
        ..Default::default()
    });
    let eviction = format!(
        "[eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.6\nlow_watermark = 0.5\ninterval_ms = 200\nlease_ms = 500\n",
        master.metrics_url
    );
    let fleet_extra = format!("records = {records}\n");
    let member = |m: &str| member(&master, &etcd, m, &eviction, &fleet_extra);
    let (a, b) = pair_of(&master, &etcd, member("a"), member("b"));
    let logs = [&master.proc, &a.proc, &b.proc, &etcd.proc];
    // The writer's 32 MiB is the pool; the reader mounts nothing.
    let steps = |mg: &Moongate, mib: &str| {
        let args = ["--segment-mib", mib];
        Background::start_args("steps", &mg.listen, &master.metadata, &args, &logs)
    };
    let (mut writer, mut reader) = (steps(&a, "32"), steps(&b, "0"));
    let bad = |line: String| -> Vec<u64> {
        let v: Value = serde_json::from_str(line.trim_start_matches("READY ")).unwrap();
        v["bad"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_u64)
            .collect()
    };
    // Hot keys (4 MiB), then older-looking filler (12 MiB): 0.5 of the pool.
    assert_eq!(bad(writer.step("put hot/ 16 262144")), Vec::<u64>::new());
    assert_eq!(bad(writer.step("put fill/ 48 262144")), Vec::<u64>::new());
    // The hot keys read through the other member, then left until their leases end.
    assert_eq!(bad(reader.step("get hot/ 16 262144")), Vec::<u64>::new());
    std::thread::sleep(Duration::from_millis(1_500));
    // 4 MiB more: 20 of 32 MiB, over the high watermark; down to 0.5 asks 4 MiB, well
    // within either member's share of the filler even if one member frees it all.
    assert_eq!(bad(writer.step("put new/ 16 262144")), Vec::<u64>::new());
    let capacity = 32u64 << 20;
    let low = (0.5 * capacity as f64) as u64;
    let allocated = || allocated(&master);
    down_to(&master, low + KIB256, &logs);
    let removed = a.metric("moongate_eviction_removed_bytes_total") as u64
        + b.metric("moongate_eviction_removed_bytes_total") as u64;
    if records {
        // Garbage where records go: refused whole with the reason, the member carries on.
        for (body, says) in [
            (&b"GET / HTTP/1.1"[..], "no MGR1 header"),
            (&b"MGR1\x2a"[..], "unknown kind 42"),
            (&b"MGR1\x04\x07\x00"[..], "truncated"),
        ] {
            let (status, text) = http_bytes(&a.admin, "POST", "/fleet/records", body).unwrap();
            let text = String::from_utf8_lossy(&text);
            assert_eq!(status, 400, "{text}");
            assert!(text.contains(says), "{text}");
        }
    }
    let missing = bad(reader.step("exist hot/ 16"));
    // Misses of evicted keys through the member that never put them: explained by the
    // keys' homes (with records) or unknown to it (without).
    let why = "moongate_lookup_misses_total{reason=\"evicted_by_moongate\",arm=\"default\"}";
    let gone = bad(reader.step("exist fill/ 48")).len() + missing.len();
    let explained = || {
        [&a, &b]
            .iter()
            .map(|m| sample_of(&m.metrics(), why).unwrap_or(0.0))
            .sum::<f64>()
    };
    if records {
        wait_for(
            "the misses explained",
            Duration::from_secs(10),
            &logs,
            || explained() >= gone as f64,
        );
    }
    let explained = explained();
    eprintln!(
        "records {records}: removed {removed} B (a {} B, b {} B); hot keys missing: {missing:?}",
        a.metric("moongate_eviction_removed_bytes_total"),
        b.metric("moongate_eviction_removed_bytes_total")
    );
    if records {
        assert!(
            b.metric("moongate_fleet_records_sent_bytes_total") > 0.0,
            "the reader's member sent records"
        );
        // A member joins: the entries whose home it becomes move to it, and back to
        // the others when it stops cleanly; no entry is lost on the way.
        let keys = |ms: &[&Moongate]| -> f64 {
            ms.iter()
                .map(|m| m.metric("moongate_eviction_table_keys"))
                .sum()
        };
        // The tables hold exactly the pool's keys, before, during and after.
        let whole = |ms: &[&Moongate]| keys(ms) as u64 * KIB256 == allocated();
        wait_for(
            "the tables hold the pool",
            Duration::from_secs(20),
            &logs,
            || whole(&[&a, &b]),
        );
        let mut c = member("c");
        wait_for("c holds its keys", Duration::from_secs(20), &logs, || {
            c.metric("moongate_eviction_table_keys") > 0.0 && whole(&[&a, &b, &c])
        });
        assert!(
            a.metric("moongate_fleet_handed_over_total")
                + b.metric("moongate_fleet_handed_over_total")
                > 0.0
        );
        c.proc.signal(libc::SIGTERM);
        let _ = c.proc.wait_exit(Duration::from_secs(20));
        wait_for("c's keys back", Duration::from_secs(20), &logs, || {
            whole(&[&a, &b])
        });
        for m in [&a, &b] {
            assert_eq!(
                m.metric("moongate_fleet_records_dropped_total{reason=\"overflow\"}")
                    + m.metric("moongate_fleet_records_dropped_total{reason=\"unsent\"}"),
                0.0,
                "{}",
                m.proc.log_text()
            );
        }
    }
    for role in [writer, reader] {
        assert_eq!(role.finish()[1][1], 0, "closed cleanly");
    }
    (missing, removed, gone, explained)
}

#[test]
fn with_access_records_keys_read_through_another_member_stay_hot() {
    let (missing, removed, gone, explained) = hot_keys_after_eviction(true);
    assert!(removed > 0, "the fleet evicted");
    assert_eq!(
        explained, gone as f64,
        "every miss of an evicted key was explained as evicted by moongate, fleet-wide"
    );
    assert_eq!(
        missing,
        Vec::<u64>::new(),
        "every hot key survived: its reads reached its home ({removed} B removed)"
    );
    // The contrast: the same run without records loses hot keys, so the test above
    // shows what records do, not luck.
    let (missing, removed, gone, explained) = hot_keys_after_eviction(false);
    assert!(
        gone > 0 && explained == 0.0,
        "without records the reader's member cannot explain its misses"
    );
    assert!(
        !missing.is_empty(),
        "without records the member that put the hot keys saw them cold and removed \
         them ({removed} B removed)"
    );
}
