//! Experiment arms that do not interfere: with `capacity = "by-weight"` each arm is held
//! to its share of the capacity and loses only its own keys, so one arm's greedy
//! eviction policy leaves the other arm's keys alone (in one shared pool it does not). The workload is
//! `benches/replay` (mirror split: both arms replay the same slice of the shipped trace
//! with the real client, every read checked).

use std::time::Duration;

use serde_json::Value;

use crate::support::*;

/// One replay against a fresh master and moongate: arm `steady` runs lru, arm `other`
/// runs `other_plugin` (with `other_config`); `capacity` is the experiment's mode.
/// Returns the replay report and moongate's metrics text.
///
/// The watermarks differ by mode. Shares hold only while the master never evicts on its
/// own (its evictions take any arm's keys): at 0.8 / 0.7 a CI run saw the master evict
/// 679 of the steady arm's keys next to lru and none next to evict-all, which moved the
/// steady arm's hit rate by 25 %; at 0.6 / 0.5 it evicted none in either. The shared
/// pool needs the pressure of 0.8 / 0.7 for its contrast to show.
fn replay(capacity: &str, other_plugin: &str, other_config: &str) -> (Value, String) {
    let (high, low) = if capacity == "by-weight" {
        (0.6, 0.5)
    } else {
        (0.8, 0.7)
    };
    let master = Master::start();
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n\
         [eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = {high}\nlow_watermark = {low}\ninterval_ms = 50\n\
         [[policy.plugins]]\nname = \"lru\"\npath = \"{}\"\n\
         [[policy.plugins]]\nname = \"other\"\npath = \"{}\"\nconfig = '{other_config}'\n\
         [experiment]\nassign = \"client\"\ncapacity = \"{capacity}\"\n\
         arms = [ {{ name = \"steady\", plugin = \"lru\", weight = 50 }},\n\
                  {{ name = \"other\", plugin = \"other\", weight = 50 }} ]\n",
        master.rpc,
        master.metrics_url,
        plugin_path("lru").display(),
        plugin_path(other_plugin).display(),
    ));
    mg.wait_ready(&master);
    let r = run_replay(
        &master,
        &mg,
        &[
            "--limit",
            "1000",
            "--speed",
            "100",
            "--value-size",
            "16384",
            "--segment-mib",
            "16",
        ],
        Duration::from_secs(300),
    );
    assert_eq!(r["arms"]["steady"]["corrupt"], 0, "{r}");
    assert_eq!(r["arms"]["other"]["corrupt"], 0, "{r}");
    (r, mg.metrics())
}

fn hit_rate(r: &Value, arm: &str) -> f64 {
    let a = &r["arms"][arm];
    a["hits"].as_f64().unwrap() / a["blocks"].as_f64().unwrap()
}

#[test]
fn with_shares_a_greedy_arm_leaves_the_other_arms_keys_alone() {
    let (calm, calm_m) = replay("by-weight", "lru", "");
    let (greedy, greedy_m) = replay("by-weight", "fault", "evict-all");
    let steady = |r: &Value| hit_rate(r, "steady");
    let steady_removed = |m: &str| {
        metric_value(
            m,
            "moongate_eviction_arm_removed_bytes_total{arm=\"steady\"}",
        )
    };
    let by_master = |m: &str| {
        metric_value(
            m,
            "moongate_lookup_misses_total{reason=\"evicted_by_master\",arm=\"steady\"}",
        )
    };
    eprintln!(
        "steady arm next to lru / evict-all: bytes moongate removed {} / {}, keys the \
         master evicted {} / {}, hit rate {:.4} / {:.4}; other arm's hit rate {:.4} / {:.4}",
        steady_removed(&calm_m),
        steady_removed(&greedy_m),
        by_master(&calm_m),
        by_master(&greedy_m),
        steady(&calm),
        steady(&greedy),
        hit_rate(&calm, "other"),
        hit_rate(&greedy, "other")
    );
    // Each other arm's policy chose its victims (the greedy one named every candidate).
    // Not compared by bytes removed: with shares both remove nearly all the other arm
    // put (376.4 M greedy vs more next to lru in a busy run), so which is larger is noise.
    let evict_ok = |m: &str| {
        m.lines()
            .filter(|l| {
                l.starts_with("moongate_policy_calls_total{")
                    && l.contains("arm=\"other\"")
                    && l.contains("hook=\"evict\"")
                    && l.contains("result=\"ok\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert!(evict_ok(&calm_m) >= 1.0, "{calm_m}");
    assert!(evict_ok(&greedy_m) >= 1.0, "{greedy_m}");
    for m in [&calm_m, &greedy_m] {
        assert!(
            metric_value(m, "moongate_eviction_rounds_total{trigger=\"arm_share\"}") >= 1.0,
            "{m}"
        );
        assert!(metric_value(m, "moongate_eviction_arm_share_bytes{arm=\"steady\"}") > 0.0);
        assert!(metric_value(m, "moongate_eviction_arm_bytes{arm=\"steady\"}") > 0.0);
    }
    // Isolation is asserted on the steady arm's keys moongate removed: both replays put
    // the same keys, so with shares the bytes removed are set by the workload and the
    // arm's own share. Measured: 374.8 M / 377.4 M quiet, 377.4 M / 377.4 M with two CPU
    // hogs beside the test. In one shared pool the same figure moves with the other
    // arm's policy (41.2 M next to lru, 289.7 M next to evict-all, quiet) and with the
    // machine's load (346.0 M / 319.2 M busy), which is why the shared-pool contrast and
    // the hit rates (a ~1 % rate that a few blocks' timing moves: 0.0102 vs 0.0078 with
    // shares on a busy machine) are measured by `benches/run_replay.sh`
    // (`CAPACITY=shared` / `by-weight`), not asserted here.
    let (a, b) = (steady_removed(&calm_m), steady_removed(&greedy_m));
    assert!(
        (a - b).abs() <= 0.1 * a.max(b),
        "by-weight: the steady arm lost {a} bytes next to lru, {b} next to evict-all"
    );
}
