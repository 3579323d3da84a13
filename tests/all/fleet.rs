//! A fleet of moongates on one pool, through a real etcd (Debian's etcd-server): members
//! see each other and lose a dead one with its lease; their evictors free the pool's
//! excess once between them, each from its own keys.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Waits for the fleet's evictors to bring the pool under `bytes` (its high watermark)
/// and for their removals to settle. As with one evictor, a round called while a
/// client still writes leaves the pool anywhere between the watermarks.
fn under(master: &Master, bytes: u64, mgs: &[&Moongate], logs: &[&Proc]) {
    wait_for(
        "the pool under the high watermark",
        Duration::from_secs(30),
        logs,
        || allocated(master) < bytes,
    );
    settled(mgs);
}

/// Members named `names` with `extra` before their `[fleet]` sections, ready and each
/// seeing all of them.
fn members_ready<S: AsRef<str>>(
    master: &Master,
    etcd: &Etcd,
    names: &[S],
    extra: &str,
) -> Vec<Moongate> {
    let mgs: Vec<Moongate> = names
        .iter()
        .map(|n| member(master, etcd, n.as_ref(), extra, ""))
        .collect();
    for mg in &mgs {
        mg.wait_ready(master);
    }
    let logs = logs_of(master, Some(etcd), &mgs);
    wait_for("every member", Duration::from_secs(60), &logs, || {
        mgs.iter().all(|m| members(m).len() == names.len())
    });
    mgs
}

/// The processes whose logs a failure quotes.
fn logs_of<'a>(master: &'a Master, etcd: Option<&'a Etcd>, mgs: &'a [Moongate]) -> Vec<&'a Proc> {
    let mut logs = vec![&master.proc];
    logs.extend(etcd.map(|e| &e.proc));
    logs.extend(mgs.iter().map(|m| &m.proc));
    logs
}

/// One real client per member (`fleetfill`), each mounting 16 MiB.
fn fill_writer(master: &Master, mgs: &[Moongate], logs: &[&Proc]) -> Background {
    let masters: Vec<&str> = mgs.iter().map(|m| m.listen.as_str()).collect();
    let masters = masters.join(",");
    let args = ["--masters", masters.as_str(), "--segment-mib", "16"];
    Background::start_args("fleetfill", &mgs[0].listen, &master.metadata, &args, logs)
}

/// Bytes each of `mgs` removed, once none removed anything for a second (rounds run
/// every 200 ms in these tests).
fn settled<M: std::borrow::Borrow<Moongate>>(mgs: &[M]) -> Vec<u64> {
    let removed = || -> Vec<u64> {
        mgs.iter()
            .map(|m| m.borrow().metric("moongate_eviction_removed_bytes_total") as u64)
            .collect()
    };
    let mut last = (removed(), Instant::now());
    while last.1.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(100));
        let r = removed();
        if r != last.0 {
            last = (r, Instant::now());
        }
    }
    last.0
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
/// watermark. The leader (a, first by name) calls the round; each frees its portion of
/// that excess (its bytes over the fleet's), so both remove keys and together they
/// remove what the round asked for, once.
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
    let allocated = || allocated(&master);
    // The round may come while b's client still writes: then the pool rests between
    // the watermarks afterwards, as with one evictor. What was asked is what the
    // leader's rounds asked (their excess when it read the usage).
    let asked = || a.metric("moongate_fleet_round_excess_bytes_total") as u64;
    // What was removed is gone and nothing else (the master evicted nothing itself):
    // once the last removal is answered and counted, the pool holds exactly the bytes
    // not removed. (Checked before the clients close: a closing client unmounts its
    // segment, and the replicas in it go with it.)
    let removed_by = |m: &Moongate| m.metric("moongate_eviction_removed_bytes_total") as u64;
    let (mut removed_a, mut removed_b) = (0, 0);
    wait_for(
        "a round, and the pool to hold exactly what was not removed, under the watermark",
        Duration::from_secs(30),
        &logs,
        || {
            (removed_a, removed_b) = (removed_by(&a), removed_by(&b));
            let now = allocated();
            asked() > 0 && now == total - removed_a - removed_b && now * 10 < capacity * 3
        },
    );
    let last = settled(&[&a, &b]);
    (removed_a, removed_b) = (last[0], last[1]);
    let removed = removed_a + removed_b;
    let asked = asked();
    let detail = format!(
        "rounds asked {asked} B (10 MiB written; 0.15 of 32 MiB is {} B); removed {removed} B \
         (a {removed_a}, b {removed_b}); pool now {} B",
        (0.15 * capacity as f64) as u64,
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
    // Only the first by name called rounds; b freed its portion on hearing of them.
    assert_eq!(
        a.metric("moongate_fleet_rounds_total{role=\"heard\"}"),
        0.0,
        "{detail}"
    );
    assert_eq!(
        b.metric("moongate_fleet_rounds_total{role=\"called\"}"),
        0.0,
        "{detail}"
    );
    assert!(
        b.metric("moongate_fleet_rounds_total{role=\"heard\"}") > 0.0,
        "{detail}"
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
    let bad = |v: Value| -> Vec<u64> {
        v["bad"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_u64)
            .collect()
    };
    // Hot keys (4 MiB), then older-looking filler (12 MiB): 0.5 of the pool.
    assert_eq!(
        bad(writer.step_json("put hot/ 16 262144")),
        Vec::<u64>::new()
    );
    assert_eq!(
        bad(writer.step_json("put fill/ 48 262144")),
        Vec::<u64>::new()
    );
    // The hot keys read through the other member, then left until their leases end.
    assert_eq!(
        bad(reader.step_json("get hot/ 16 262144")),
        Vec::<u64>::new()
    );
    std::thread::sleep(Duration::from_millis(1_500));
    // 4 MiB more: 20 of 32 MiB, over the high watermark; down to 0.5 asks 4 MiB, well
    // within either member's share of the filler even if one member frees it all.
    assert_eq!(
        bad(writer.step_json("put new/ 16 262144")),
        Vec::<u64>::new()
    );
    let capacity = 32u64 << 20;
    let allocated = || allocated(&master);
    under(&master, (0.6 * capacity as f64) as u64, &[&a, &b], &logs);
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
    let missing = bad(reader.step_json("exist hot/ 16"));
    // Misses of evicted keys through the member that never put them: explained by the
    // keys' homes (with records) or unknown to it (without).
    let why = "moongate_lookup_misses_total{reason=\"evicted_by_moongate\",arm=\"default\"}";
    let gone = bad(reader.step_json("exist fill/ 48")).len() + missing.len();
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

/// What a fleet of `n` moongates (`fleet` on or off) did with a pool written past its
/// capacity: one client per member (all in one process), each mounting 16 MiB, writing
/// fresh 1 MiB keys in turn through every member until 1.3 times the pool was written;
/// `[eviction]` at 0.8 / 0.7 on every member, rounds every 200 ms.
struct Race {
    capacity: u64,
    /// The pool's usage, sampled every 10 ms: its peak, and its lowest after the peak.
    peak: u64,
    lowest_after: u64,
    /// Bytes the members removed, and what the watermarks asked for at most: everything
    /// written beyond the low watermark.
    removed: u64,
    asked: u64,
    /// Bytes each member removed, in MiB.
    per_member: Vec<u64>,
    /// The master's own evictions (the backstop): none when the fleet kept up.
    master_evicted: f64,
    /// Puts that failed.
    bad: Value,
}

impl Race {
    fn share(&self, bytes: u64) -> f64 {
        bytes as f64 / self.capacity as f64
    }

    fn describe(&self) -> String {
        format!(
            "peak {:.3}, lowest after it {:.3}; removed {:.3} of the pool, asked {:.3}; \
             the master evicted {} keys; failed puts {}; MiB removed by member {:?}",
            self.share(self.peak),
            self.share(self.lowest_after),
            self.share(self.removed),
            self.share(self.asked),
            self.master_evicted,
            self.bad,
            self.per_member
        )
    }
}

fn race(n: usize, fleet: bool) -> Race {
    const SEG: u64 = 16 << 20;
    let etcd = fleet.then(Etcd::start);
    let master = Master::start();
    // 100 ms rounds: the writer fills ~0.1 of the pool in 200 ms, and in a fleet only
    // the leader reads the usage, so the pool may rise that far past the watermark
    // before a round, as it would with one evictor.
    let eviction = format!(
        "[eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.8\nlow_watermark = 0.7\ninterval_ms = 100\n",
        master.metrics_url
    );
    let mgs: Vec<Moongate> = match &etcd {
        Some(e) => {
            let names: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
            members_ready(&master, e, &names, &eviction)
        }
        None => (0..n)
            .map(|_| {
                let mg = Moongate::start_config(&format!(
                    "[master_face]\nupstream = \"{}\"\n{eviction}",
                    master.rpc
                ));
                mg.wait_ready(&master);
                mg
            })
            .collect(),
    };
    let logs = logs_of(&master, etcd.as_ref(), &mgs);
    let mut w = fill_writer(&master, &mgs, &logs);
    let capacity = SEG * n as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        let rest = master.metrics_url.trim_start_matches("http://").to_string();
        std::thread::spawn(move || {
            let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Some(v) =
                    http_get(addr, path).and_then(|(_, b)| sample_of(&b, "master_allocated_bytes"))
                {
                    samples.push(v as u64);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            samples
        })
    };
    let written = capacity * 13 / 10;
    let done = w.step_json(&format!("put k/ {written} 1048576"));
    let per_member = settled(&mgs);
    let removed: u64 = per_member.iter().sum();
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().unwrap();
    let peak_at = samples
        .iter()
        .enumerate()
        .max_by_key(|(_, v)| **v)
        .map_or(0, |(i, _)| i);
    let low = capacity * 7 / 10;
    // The writer is stopped, not closed: closing 16 clients one by one takes ~25 s.
    drop(w);
    Race {
        capacity,
        peak: samples.get(peak_at).copied().unwrap_or(u64::MAX),
        lowest_after: samples[peak_at..].iter().copied().min().unwrap_or(0),
        removed,
        asked: written - low,
        per_member: per_member.iter().map(|b| b >> 20).collect(),
        master_evicted: sample_of(&master.metrics(), "master_evicted_key_count").unwrap_or(-1.0),
        bad: done["bad"].clone(),
    }
}

/// What a fleet of members does with the pool's excess, as one evictor would: `Err`
/// says which bound a run broke.
/// - It frees what the watermarks ask for once: at least what brings the pool under the
///   high watermark, at most what brings it to the low one, within 10 % either way.
/// - The pool stays within [0.65, 0.90] of its capacity: below, over-eviction; above,
///   the master's own eviction (its `eviction_high_watermark_ratio`, 0.9) would start.
///   How far the pool rises past 0.8 is the writer's lead over the 100 ms rounds (a
///   peak of 0.855 seen).
/// - Each member frees its portion: every member removed at least one key. Members
///   without a fleet free all of their own keys or none, depending on when their rounds
///   fall (measured: 6 to 10 of 16 removed nothing in every run), and 16 members each
///   freeing all of its keys would free far more than the excess.
fn fleet_verdict(r: &Race) -> Result<(), String> {
    let d = r.describe();
    let at_least = r.asked - r.capacity / 10;
    if r.removed * 10 < at_least * 9 || r.removed * 10 > r.asked * 11 {
        return Err(format!(
            "removed not what was asked, once, within 10 %: {d}"
        ));
    }
    if r.lowest_after * 100 < r.capacity * 65 || r.peak * 100 > r.capacity * 90 {
        return Err(format!("the pool left [0.65, 0.90] of its capacity: {d}"));
    }
    if r.per_member.contains(&0) {
        return Err(format!("a member removed nothing: {d}"));
    }
    Ok(())
}

/// 16 members, each beside a client writing fresh keys past the pool: the fleet frees
/// the pool's excess once, each member its portion ([`fleet_verdict`]), and the master's
/// own eviction never runs.
#[test]
fn sixteen_members_free_the_pools_excess_once() {
    let r = race(16, true);
    let d = r.describe();
    eprintln!("16 members with [fleet]: {d}");
    assert_eq!(r.bad, serde_json::json!([]), "{d}");
    if let Err(e) = fleet_verdict(&r) {
        panic!("{e}");
    }
    assert_eq!(
        r.master_evicted, 0.0,
        "the master's own eviction never ran: {d}"
    );
}

/// The contrast: the same run with `[fleet]` off falls outside what a fleet does (the
/// test above fails without the fleet). Its clients are served all the same.
#[test]
fn sixteen_members_without_the_fleet_do_not_free_the_excess_as_one() {
    let r = race(16, false);
    let d = r.describe();
    eprintln!("16 members without [fleet]: {d}");
    assert_eq!(r.bad, serde_json::json!([]), "{d}");
    let verdict = fleet_verdict(&r);
    eprintln!("{verdict:?}");
    assert!(
        verdict.is_err(),
        "without the fleet the run passed for a fleet: {d}"
    );
}

/// Both, alternating, three times each, for docs/results.md. Run it with
/// `cargo test --test all -- --ignored fleet::fleet_race_with_and_without_the_fleet --nocapture`.
#[test]
#[ignore = "a measurement for docs/results.md, a minute long"]
fn fleet_race_with_and_without_the_fleet() {
    for fleet in [false, true, false, true, false, true] {
        let r = race(16, fleet);
        eprintln!(
            "16 members, [fleet] {}: {} -> {:?}",
            if fleet { "on" } else { "off" },
            r.describe(),
            fleet_verdict(&r)
        );
    }
}

/// By-weight shares across a fleet, arms assigned by member (one sidecar per rank, two
/// ranks per arm): arm `a`'s ranks write twice its share, arm `b`'s half of its; the
/// fleet holds `a` at its watermarks of its share of the whole pool (not one share per
/// member) and takes nothing from `b`.
#[test]
fn by_weight_shares_hold_for_the_whole_pool_with_arms_by_member() {
    use moongate::policy::experiment::{arm_for_hash, fnv1a};
    const MIB: u64 = 1 << 20;
    let arm_of = |name: &str| arm_for_hash(fnv1a(name.as_bytes()), [50u64, 50].into_iter());
    let names: Vec<String> = (0..100).map(|i| format!("rank{i}")).collect();
    let pick = |arm: usize| -> Vec<&String> {
        names.iter().filter(|n| arm_of(n) == arm).take(2).collect()
    };
    let ranks: Vec<&String> = pick(0).into_iter().chain(pick(1)).collect();
    let etcd = Etcd::start();
    let master = Master::start();
    let cfg = format!(
        "[eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.6\nlow_watermark = 0.5\ninterval_ms = 200\n\
         [[policy.plugins]]\nname = \"lru\"\npath = \"{}\"\n\
         [experiment]\nassign = \"member\"\ncapacity = \"by-weight\"\n\
         arms = [ {{ name = \"a\", plugin = \"lru\", weight = 50 }},\n\
                  {{ name = \"b\", plugin = \"lru\", weight = 50 }} ]\n",
        master.metrics_url,
        plugin_path("lru").display(),
    );
    let mgs = members_ready(&master, &etcd, &ranks, &cfg);
    let logs = logs_of(&master, Some(&etcd), &mgs);
    let mut w = fill_writer(&master, &mgs, &logs);
    let ok = |v: Value| assert_eq!(v["bad"], serde_json::json!([]), "{v}");
    // The pool is 64 MiB: 32 MiB per arm. b: 16 MiB through its ranks (clients 2, 3).
    ok(w.step_json(&format!("put b/ {} {MIB} 2,3", 16 * MIB)));
    // a: 64 MiB through its ranks, twice its share, 8 MiB at a time: each step waits
    // for the fleet to bring the pool back under a's high watermark. (Written at once,
    // the writer outruns 200 ms rounds and the master's own eviction, which takes the
    // oldest keys of any arm, runs: seen taking 4 of b's keys.)
    let high = 16 * MIB + 32 * MIB * 6 / 10;
    for step in 0..8 {
        ok(w.step_json(&format!("put a/ {} {MIB} 0,1 {}", 8 * MIB, step * 8)));
        wait_for(
            "the pool under a's high watermark",
            Duration::from_secs(30),
            &logs,
            || allocated(&master) <= high,
        );
    }
    let removed: u64 = settled(&mgs).iter().sum();
    let mut found = |prefix: &str, n: u64| -> u64 {
        w.step_json(&format!("exist {prefix} {n}"))["found"]
            .as_u64()
            .unwrap()
    };
    let (a, b) = (found("a/", 64) * MIB, found("b/", 16) * MIB);
    let share = 32 * MIB;
    let detail = format!(
        "members {ranks:?}: arm a holds {} MiB, arm b {} MiB of 32 MiB shares; removed {} MiB",
        a / MIB,
        b / MIB,
        removed / MIB
    );
    eprintln!("{detail}");
    assert_eq!(b, 16 * MIB, "arm b lost nothing: {detail}");
    // Held between its watermarks (0.5 and 0.6 of its share), within 10 %: one share for
    // the whole pool. (Each step above already waited for it to come under 0.6 of it: a
    // member counting only the keys homed at it, a quarter of a's, never would have.)
    assert!(
        a * 10 >= share / 2 * 9 && a * 10 <= share * 6 / 10 * 11,
        "arm a within its share: {detail}"
    );
    assert_eq!(
        sample_of(&master.metrics(), "master_evicted_key_count"),
        Some(0.0),
        "{detail}"
    );
}

/// A member SIGKILLed under load: the others drop it from their views within its lease
/// and take over its part of the excess (their portions are their bytes over the live
/// members'); together they free what the watermark asks for, each key once, and every
/// value read afterwards is the one that was put.
#[test]
fn a_killed_members_portion_moves_to_the_others_and_nothing_is_removed_twice() {
    const MIB: u64 = 1 << 20;
    // 256 KiB keys: fine enough for a 10 % bound on ~7.4 MiB.
    const KEY: u64 = 256 << 10;
    let etcd = Etcd::start();
    let master = Master::start();
    let eviction = format!(
        "[eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.8\nlow_watermark = 0.7\ninterval_ms = 200\n",
        master.metrics_url
    );
    let mgs = members_ready(&master, &etcd, &["m0", "m1", "m2"], &eviction);
    let logs = logs_of(&master, Some(&etcd), &mgs);
    let mut w = fill_writer(&master, &mgs, &logs);
    let step = |w: &mut Background, cmd: &str| w.step_json(cmd);
    // 48 MiB pool (three clients' segments). 0.6 of it through all three members.
    let first = step(&mut w, &format!("put k/ {} {KEY} all 0", 29 * MIB));
    assert_eq!(first["bad"], serde_json::json!([]), "{first}");
    let t0 = Instant::now();
    mgs[2].proc.signal(libc::SIGKILL);
    let live = &mgs[..2];
    wait_for(
        "the killed member gone",
        Duration::from_secs(10),
        &logs,
        || live.iter().all(|m| members(m).len() == 2),
    );
    let gone_after = t0.elapsed();
    // Over the high watermark through the two that live: 12 MiB more, 41 of 48 MiB.
    let more = step(
        &mut w,
        &format!("put k/ {} {KEY} 0,1 {}", 12 * MIB, 29 * MIB / KEY),
    );
    assert_eq!(more["bad"], serde_json::json!([]), "{more}");
    let (written, capacity) = (41 * MIB, 48 * MIB);
    // As one evictor reads the watermarks: at least under the high one, at most down
    // to the low one.
    let (least, most) = (written - capacity * 8 / 10, written - capacity * 7 / 10);
    let removed_by = |m: &Moongate| m.metric("moongate_eviction_removed_bytes_total") as u64;
    let mut removed = (0, 0);
    wait_for(
        "the pool to hold exactly what was not removed, under the high watermark",
        Duration::from_secs(20),
        &logs,
        || {
            removed = (removed_by(&live[0]), removed_by(&live[1]));
            let now = allocated(&master);
            now == written - removed.0 - removed.1 && now < capacity * 8 / 10
        },
    );
    // Then settled (a round in flight frees the rest).
    let last = settled(live);
    let removed = (last[0], last[1]);
    let total = removed.0 + removed.1;
    assert_eq!(
        allocated(&master),
        written - total,
        "every removal counted once"
    );
    let detail = format!(
        "gone from both views {gone_after:?} after SIGKILL (lease 2 s); asked {least}-{most} B, \
         removed {total} B ({} + {})",
        removed.0, removed.1
    );
    eprintln!("{detail}");
    // Measured 1.9-2.4 s on a quiet machine; the bound leaves a busy one room for etcd's
    // lease checks and the watch.
    assert!(
        gone_after < Duration::from_secs(6),
        "about one lease: {detail}"
    );
    // Each removal freed bytes that were there (the pool is exactly what was written
    // less what was removed: no key was counted twice), together what was asked.
    assert!(
        total * 10 >= least * 9 && total * 10 <= most * 11,
        "the two that live freed the excess, within 10 %: {detail}"
    );
    assert!(
        removed.0 > 0 && removed.1 > 0,
        "both took a portion: {detail}"
    );
    let check = step(&mut w, &format!("check k/ {} {KEY} 0", written / KEY));
    assert_eq!(check["wrong"], 0, "{check}");
    assert_eq!(
        check["found"].as_u64().unwrap() * KEY,
        written - total,
        "what was not removed is there: {check} {detail}"
    );
    assert_eq!(
        sample_of(&master.metrics(), "master_evicted_key_count"),
        Some(0.0),
        "{detail}"
    );
}

/// A forced removal a rank sends through one member voids the replica cache of another
/// member's kv face: without the word through etcd, the other member would read the
/// removed key from its cached replica list for as long as the cache holds (60 s here),
/// from memory the master may hand to a new put.
#[test]
fn a_forced_removal_through_one_member_voids_another_members_replica_cache() {
    let etcd = Etcd::start();
    let master = Master::start_with(MasterOpts {
        extra: vec!["--default_kv_lease_ttl=120000".into()],
        ..Default::default()
    });
    let kv = format!("127.0.0.1:{}", free_port());
    let kv_extra = format!(
        "[kv]\nlisten = \"{kv}\"\nmetadata_url = \"{}\"\nreplica_cache_ms = 60000\n",
        master.metadata
    );
    let (a, b) = pair_of(
        &master,
        &etcd,
        member(&master, &etcd, "a", "", ""),
        member(&master, &etcd, "b", &kv_extra, ""),
    );
    let logs = [&master.proc, &a.proc, &b.proc, &etcd.proc];
    let args = ["--segment-mib", "16"];
    let mut rank = Background::start_args("steps", &a.listen, &master.metadata, &args, &logs);
    let ok = |v: Value| assert_eq!(v["bad"], serde_json::json!([]), "{v}");
    ok(rank.step_json("put fv/ 2 5000"));
    let m = |mg: &Moongate, name: &str| metric_value(&mg.metrics(), name);
    let hits = || m(&b, "moongate_kv_replica_cache_total{result=\"hit\"}");
    // Read until one read comes from b's cache (on a busy machine an etcd or master
    // call that times out voids b's places, and the next read asks the master again).
    wait_for(
        "a read from b's cache",
        Duration::from_secs(20),
        &logs,
        || {
            let (st, body) = http_bytes(&kv, "GET", "/v1/kv/fv%2F0", &[]).unwrap();
            assert!(
                st == 200 && body == value_of("fv/0", 5000),
                "{st}\n{}",
                b.proc.log_text()
            );
            hits() >= 1.0
        },
    );
    // The rank's forced removal goes through a only (b's reads leased fv/0: forced
    // takes it anyway).
    ok(rank.step_json("forcerm fv/ 1"));
    wait_for(
        "b to read fv/0 as removed",
        // Well within the cached entry's 60 s: without the fleet's word b would serve
        // it from the cache all that time.
        Duration::from_secs(30),
        &logs,
        || http_bytes(&kv, "GET", "/v1/kv/fv%2F0", &[]).is_some_and(|(st, _)| st == 404),
    );
    assert!(m(&a, "moongate_fleet_removals_told_total") >= 1.0);
    assert!(m(&b, "moongate_fleet_removals_heard_total") >= 1.0);
    // The other key reads as before (asked of the master anew).
    let (st, body) = http_bytes(&kv, "GET", "/v1/kv/fv%2F1", &[]).unwrap();
    assert!(st == 200 && body == value_of("fv/1", 5000));
    rank.end(Duration::from_secs(60));
}
