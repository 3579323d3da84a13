//! `benches/replay` end to end on a slice of the shipped trace: two experiment arms
//! (lru and prefix-evict eviction, by client) with moongate-driven eviction, the real
//! client in worker processes, every read checked byte for byte, a per-arm report; and
//! the same with hints sent (lru and hint-lru).

use std::time::Duration;

use crate::support::*;

/// moongate with moongate-driven eviction and an experiment by client: arm `lru` and
/// arm `second` (name, plugin), with `capacity` shares; ready.
fn two_arms(master: &Master, second: (&str, &str), capacity: &str) -> Moongate {
    let (arm, plugin) = second;
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n\
         [eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.8\nlow_watermark = 0.7\ninterval_ms = 100\n\
         [[policy.plugins]]\nname = \"lru\"\npath = \"{}\"\n\
         [[policy.plugins]]\nname = \"{plugin}\"\npath = \"{}\"\n\
         [experiment]\nassign = \"client\"\ncapacity = \"{capacity}\"\n\
         arms = [ {{ name = \"lru\", plugin = \"lru\", weight = 50 }},\n\
                  {{ name = \"{arm}\", plugin = \"{plugin}\", weight = 50 }} ]\n",
        master.rpc,
        master.metrics_url,
        plugin_path("lru").display(),
        plugin_path(plugin).display(),
    ));
    mg.wait_ready(master);
    mg
}

#[test]
fn replay_reports_both_arms_of_an_experiment() {
    let master = Master::start();
    let mg = two_arms(&master, ("prefix", "prefix-evict"), "shared");
    let r = run_replay(
        &master,
        &mg,
        &[
            "--limit",
            "200",
            "--speed",
            "1000",
            "--value-size",
            "16384",
            "--segment-mib",
            "16",
        ],
        Duration::from_secs(240),
    );
    let arms = r["arms"].as_object().unwrap();
    assert_eq!(arms.keys().collect::<Vec<_>>(), ["lru", "prefix"], "{r}");
    let total = |k: &str| arms.values().map(|a| a[k].as_f64().unwrap()).sum::<f64>();
    assert_eq!(
        total("requests"),
        400.0,
        "both arms replay all 200 requests"
    );
    assert_eq!(total("corrupt"), 0.0);
    for (name, a) in arms {
        assert!(a["requests"].as_f64().unwrap() > 0.0, "{name}: {a}");
        assert!(a["put_keys"].as_f64().unwrap() > 0.0, "{name}: {a}");
        assert!(a["lookup_p50_us"].as_f64().unwrap() > 0.0, "{name}: {a}");
    }
    assert!(
        total("hits") > 0.0,
        "the trace's first requests share prefixes: {r}"
    );
    assert_eq!(
        total("read_ok") + total("read_miss"),
        total("hits"),
        "every prefix hit was read: {r}"
    );
    // Both plugins were asked for victims under the 16 MiB segments.
    let m = mg.metrics();
    assert!(
        metric_value(&m, "moongate_eviction_rounds_total{trigger=\"usage\"}") >= 1.0,
        "{m}"
    );
}

/// `benches/replay --hints`: the simulator's hint model sent live (the router's queue
/// by the replay, ended sessions by the worker that served them) next to an LRU arm:
/// every hint is taken, the hint-reading arm's eviction rounds see them, and every read
/// is byte-exact. (What they are worth is measured by benches/hints_live.sh, not here.)
#[test]
fn a_replay_sends_hints_and_the_hint_reading_arm_sees_them() {
    let master = Master::start();
    let mg = two_arms(&master, ("hint", "hint-lru"), "by-weight");
    let r = run_replay(
        &master,
        &mg,
        &[
            "--limit",
            "200",
            "--speed",
            "1000",
            "--value-size",
            "16384",
            "--segment-mib",
            "16",
            "--hints",
            "queue:16,last:1",
        ],
        Duration::from_secs(240),
    );
    let h = &r["hints"];
    assert!(h["names"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(h["accepted"], h["names"], "{r}");
    assert_eq!(h["refused"], serde_json::json!({}), "{r}");
    assert!(h["worker_done_hints"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(h["worker_done_hint_errors"], 0, "{r}");
    for arm in ["lru", "hint"] {
        assert_eq!(r["arms"][arm]["corrupt"], 0, "{r}");
    }
    // Only the arm whose plugin reads hints has its candidates looked up.
    assert!(
        mg.metric("moongate_hints_matched_total{kind=\"upcoming\"}") > 0.0,
        "{r}\n{}",
        mg.metrics()
    );
    // The evictor's rounds tell the table the cache's turnover, which upcoming and
    // expect hints hold past their due time by.
    assert!(
        mg.metric("moongate_hints_turnover_ms") > 0.0,
        "{}",
        mg.metrics()
    );
    assert!(mg.metric("moongate_hints_bytes") > 0.0, "{}", mg.metrics());
}
