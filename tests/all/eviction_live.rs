//! moongate-driven eviction against the real master and the real client: the usage
//! trigger reads the master's own metrics, the plugin picks the victims, moongate
//! removes them on its own connection; a broken trigger source leaves traffic alone.

use crate::support::*;
use serde_json::Value;

fn eviction_config(master: &Master, plugin: &str, extra: &str) -> String {
    format!(
        "[master_face]\nupstream = \"{}\"\n\
         [eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.6\nlow_watermark = 0.56\ninterval_ms = 200\n{extra}\n\
         [policy]\nactive = \"p\"\n\
         [[policy.plugins]]\nname = \"p\"\npath = \"{}\"\n",
        master.rpc,
        master.metrics_url,
        plugin_path(plugin).display()
    )
}

/// Puts 20 chains of 8 x 64 KiB blocks (10 MiB) into a 16 MiB segment, above the 0.6
/// watermark; returns the blocks still there after moongate's round, by chain position.
fn chains_after_eviction(plugin: &str) -> (Vec<Vec<bool>>, String) {
    chains_after_eviction_with(plugin, None)
}

/// [`chains_after_eviction`], with `pages` (given the master's page) as
/// `eviction.master_metrics_url`.
fn chains_after_eviction_with(
    plugin: &str,
    pages: Option<&dyn Fn(&str) -> String>,
) -> (Vec<Vec<bool>>, String) {
    let master = Master::start();
    let mut cfg = eviction_config(&master, plugin, "");
    if let Some(pages) = pages {
        let url = format!("master_metrics_url = \"{}\"", master.metrics_url);
        cfg = cfg.replace(
            &url,
            &format!("master_metrics_url = \"{}\"", pages(&master.metrics_url)),
        );
    }
    let mg = Moongate::start_config(&cfg);
    mg.wait_ready(&master);
    let logs = [&master.proc, &mg.proc];
    let client = Background::start_args(
        "chains",
        &mg.listen,
        &master.metadata,
        &["--count", "20", "--prefix", "c/"],
        &logs,
    );
    wait_for(
        "an eviction round that removed keys",
        std::time::Duration::from_secs(20),
        &logs,
        || mg.metric("moongate_eviction_keys_total{result=\"removed\"}") >= 1.0,
    );
    // The round that removed keys has ended (all its removals answered) before looking.
    let started = mg.metric("moongate_eviction_rounds_total{trigger=\"usage\"}")
        + mg.metric("moongate_eviction_rounds_total{trigger=\"denials\"}");
    wait_for(
        "the eviction round ends",
        std::time::Duration::from_secs(20),
        &logs,
        || mg.metric("moongate_eviction_rounds_ended_total") >= started,
    );
    let r = client.finish();
    let puts = &r
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o[0] == "puts")
        .unwrap()[1];
    assert!(
        puts.as_array()
            .unwrap()
            .iter()
            .all(|v| v == &Value::from(0)),
        "{puts}"
    );
    let exists = r
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o[0] == "exists")
        .unwrap()[1]
        .clone();
    let grid = (0..20)
        .map(|c| (0..8).map(|b| exists[format!("c/{c}/{b}")] == 1).collect())
        .collect();
    (grid, mg.metrics())
}

#[test]
fn prefix_evict_removes_leaf_blocks_and_keeps_shared_prefixes() {
    let (grid, m) = chains_after_eviction("prefix-evict");
    let v = |s: &str| metric_value(&m, s);
    let removed = v("moongate_eviction_keys_total{result=\"removed\"}");
    let gone: Vec<(usize, usize)> = grid
        .iter()
        .enumerate()
        .flat_map(|(c, ch)| {
            ch.iter()
                .enumerate()
                .filter(|(_, e)| !**e)
                .map(move |(b, _)| (c, b))
        })
        .collect();
    assert!(removed >= 10.0, "only {removed} removed\n{m}");
    assert_eq!(gone.len() as f64, removed, "{gone:?}");
    assert!(
        gone.iter().all(|&(_, b)| b == 7),
        "a shared prefix block was evicted while leaves were left: {gone:?}"
    );
    assert!(v("moongate_eviction_rounds_total{trigger=\"usage\"}") >= 1.0);
    assert!(v("moongate_plugin_counter_total{plugin=\"p\",name=\"victims_leaf\"}") >= removed);
    assert_eq!(v("moongate_eviction_keys_total{result=\"leased\"}"), 0.0);
    let ppm = v("moongate_master_memory_usage_ppm");
    assert!(
        ppm > 0.0 && ppm < 600_000.0,
        "usage after the round: {ppm} ppm"
    );
}

#[test]
fn lru_evicts_the_oldest_chains_whole() {
    let (grid, m) = chains_after_eviction("lru");
    let removed = metric_value(&m, "moongate_eviction_keys_total{result=\"removed\"}");
    assert!(removed >= 10.0, "{m}");
    // The first chain put is the least recently used: it goes first, prefix and all.
    assert!(grid[0].iter().all(|e| !e), "{grid:?}");
    assert!(grid[19].iter().all(|e| *e), "{grid:?}");
}

/// Behind an HA pair the usage trigger reads each master's page in turn: the first that
/// answers with a capacity (a leader's) is read, so a dead master named first (as after
/// a failover) does not pause it.
#[test]
fn the_usage_trigger_reads_the_first_page_that_answers() {
    let dead = format!("http://127.0.0.1:{}/metrics", free_port());
    let pages = move |real: &str| format!("{dead}, {real}");
    let (grid, m) = chains_after_eviction_with("lru", Some(&pages));
    assert!(
        metric_value(&m, "moongate_eviction_rounds_total{trigger=\"usage\"}") >= 1.0,
        "{m}"
    );
    assert!(grid[0].iter().all(|e| !e), "{grid:?}");
}

/// An unreadable master metrics endpoint pauses the usage trigger; calls carry on.
#[test]
fn a_dead_usage_source_is_counted_and_traffic_carries_on() {
    let master = Master::start();
    let dead = format!("http://127.0.0.1:{}/metrics", free_port());
    let mut cfg = eviction_config(&master, "lru", "");
    cfg = cfg.replace(&master.metrics_url, &dead);
    let mg = Moongate::start_config(&cfg);
    mg.wait_ready(&master);
    wait_for(
        "a usage read error",
        std::time::Duration::from_secs(10),
        &[&mg.proc],
        || mg.metric("moongate_eviction_errors_total{stage=\"usage\"}") >= 2.0,
    );
    let r = run_role(
        "demo",
        &mg.listen,
        &master.metadata,
        &[],
        &[&master.proc, &mg.proc],
    );
    assert_eq!(
        r.as_array().unwrap()[1][1],
        serde_json::json!({"puts": 200, "hits": 200, "gets": 100}),
        "{r}"
    );
    assert!(mg.proc.log_text().contains("usage trigger paused"));
}

/// Lookup misses are explained: a key a client removed and a key never stored, counted
/// by reason and arm, and `GET /keys/{key}` tells one key's story.
#[test]
fn lookup_misses_are_explained() {
    let master = Master::start();
    let mg = Moongate::start_config(&eviction_config(&master, "lru", ""));
    mg.wait_ready(&master);
    let r = run_role(
        "misses",
        &mg.listen,
        &master.metadata,
        &[],
        &[&master.proc, &mg.proc],
    );
    assert_eq!(result(&r, "remove"), 0, "{r}");
    assert_eq!(result(&r, "exist").to_string(), "[1,0,0]", "{r}");
    let m = mg.metrics();
    let misses = |why: &str| {
        metric_value(
            &m,
            &format!("moongate_lookup_misses_total{{reason=\"{why}\",arm=\"p\"}}"),
        )
    };
    assert_eq!(misses("removed_by_client"), 1.0, "{m}");
    assert_eq!(misses("never_stored"), 1.0, "{m}");
    let key = |k: &str| -> Value {
        let (st, body) = http_get(&mg.admin, &format!("/keys/{k}")).unwrap();
        assert_eq!(st, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    let rm = key("m%2Frm");
    assert_eq!(rm["last_end"]["why"], "removed_by_client", "{rm}");
    assert!(rm["stored"].is_null(), "{rm}");
    let kept = key("m%2Fkept");
    assert_eq!(kept["stored"]["size"], 1024, "{kept}");
    assert!(kept["stored"]["hits"].as_u64().unwrap() >= 1, "{kept}");
    let never = key("m%2Fnever");
    assert!(
        never["stored"].is_null() && never["last_end"].is_null(),
        "{never}"
    );
}
