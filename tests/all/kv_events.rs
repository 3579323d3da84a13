//! KV events end to end: the real master, moongate with `[events]` on, a real client's
//! scripted workload, and a subscriber written as routers write them (pyzmq, msgspec with
//! vLLM's declared structures for the encoding under test):
//! - vLLM's earlier array encoding, the lru plugin (the SDK's default names the replay's
//!   `PREFIX/blk/HASH` keys), a subscriber that misses a phase and replays it;
//! - vLLM's current map encoding (the default), the embedded default policy and keys as
//!   vLLM's MooncakeStoreConnector names them.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::*;

/// Both endpoints moongate logged, e.g. `tcp://127.0.0.1:40123`.
pub(crate) fn endpoints(mg: &Moongate) -> (String, String) {
    wait_for("events bound", Duration::from_secs(10), &[&mg.proc], || {
        mg.proc.log_text().contains("KV events publishing")
    });
    let log = mg.proc.log_text();
    let field = |name: &str| {
        log.split(&format!("{name}="))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .expect("endpoint in the log")
            .to_string()
    };
    (field("endpoint"), field("replay"))
}

/// Waits until the publisher has handled every queued change.
pub(crate) fn wait_published(mg: &Moongate) {
    wait_for(
        "events published",
        Duration::from_secs(10),
        &[&mg.proc],
        || {
            let m = mg.metrics();
            let q = metric_value(&m, "moongate_events_changes_total{state=\"queued\"}");
            q > 0.0 && q == metric_value(&m, "moongate_events_changes_total{state=\"handled\"}")
        },
    );
}

#[test]
fn every_event_of_a_real_workload_reaches_a_vllm_subscriber_and_gaps_replay() {
    let master = Master::start();
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n\
         [eviction]\nenabled = true\nmaster_metrics_url = \"{}\"\n\
         high_watermark = 0.5\nlow_watermark = 0.3\ninterval_ms = 100\n\
         [events]\nenabled = true\nendpoint = \"tcp://127.0.0.1:0\"\n\
         replay_endpoint = \"tcp://127.0.0.1:0\"\nencoding = \"array\"\n\
         [policy]\nactive = \"p\"\n\
         [[policy.plugins]]\nname = \"p\"\npath = \"{}\"\n",
        master.rpc,
        master.metrics_url,
        plugin_path("lru").display()
    ));
    mg.wait_ready(&master);
    let (endpoint, replay) = endpoints(&mg);

    let mut sub = subscriber(&endpoint, &replay, "array", &mg);

    let logs = [&master.proc, &mg.proc];
    let mut work = Background::start("events", &mg.listen, &master.metadata, &logs);
    assert_eq!(work.ready_line, "READY 1");
    wait_published(&mg);
    // Phase 2 is published while the subscriber is away: a real gap.
    sub.step("pause");
    assert_eq!(work.step("go"), "READY 2");
    wait_published(&mg);
    sub.step("resume");
    assert_eq!(work.step("go"), "READY 3");
    // moongate's usage round has run (10 MiB in a 16 MiB pool, over the 0.5 mark).
    wait_for("keys evicted", Duration::from_secs(10), &logs, || {
        mg.metric("moongate_eviction_keys_total{result=\"removed\"}") >= 1.0
    });
    let r = work.finish();
    wait_published(&mg);
    let batches = mg.metric("moongate_events_batches_total");
    sub.step(&format!("finish {batches}"));
    let got: Value = serde_json::from_str(&std::fs::read_to_string(&sub.out).unwrap()).unwrap();
    let m = mg.metrics();

    // Every batch arrived, in order, some of them by replay.
    let seqs: Vec<u64> = got["batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..batches as u64).collect::<Vec<_>>(), "{got}");
    assert!(got["gaps"].as_u64().unwrap() >= 1, "{got}");
    assert!(!got["replayed"].as_array().unwrap().is_empty(), "{got}");
    assert!(
        metric_value(&m, "moongate_events_replays_total") >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric_value(&m, "moongate_events_dropped_total"),
        0.0,
        "{m}"
    );
    // `plain` names no block.
    assert_eq!(
        metric_value(&m, "moongate_events_unmapped_keys_total"),
        1.0,
        "{m}"
    );

    let events: Vec<Value> = got["batches"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["events"].as_array().unwrap().clone())
        .collect();
    // Phases 1 and 2 exactly: the chain in one event, the single put, its removal, the
    // late chain, the RemoveAll.
    let first_big = events
        .iter()
        .position(|e| e["hashes"][0].as_u64().is_some_and(|h| h >= 1000))
        .unwrap_or(events.len());
    let stored = |hashes: Vec<u64>| {
        json!({"type": "BlockStored", "hashes": hashes, "parent": null,
               "block_size": 16, "medium": "MEMORY"})
    };
    assert_eq!(
        events[..first_big],
        [
            stored((1..=8).collect()),
            stored(vec![100]),
            json!({"type": "BlockRemoved", "hashes": [100], "medium": "MEMORY"}),
            stored((200..=203).collect()),
            json!({"type": "AllBlocksCleared"}),
        ],
        "{got}\n{r}"
    );
    // Phase 3: what the events say is stored is exactly what the client finds.
    let mut held = BTreeSet::new();
    for e in &events[first_big..] {
        let hashes = e["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap());
        match e["type"].as_str().unwrap() {
            "BlockStored" => {
                assert_eq!(e["medium"], "MEMORY", "{e}");
                held.extend(hashes);
            }
            "BlockRemoved" => {
                for h in hashes {
                    held.remove(&h);
                }
            }
            other => panic!("unexpected {other}: {got}"),
        }
    }
    let exist = result(&r, "exist_big");
    let found: BTreeSet<u64> = exist
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, v)| v.as_i64() == Some(1))
        .map(|(k, _)| k.rsplit('/').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(held, found, "events vs the store\n{got}\n{r}");
    // The workload did what it is for: some stored, some evicted.
    assert!(!found.is_empty() && found.len() < 40, "{r}\n{m}");
    assert!(
        metric_value(&m, "moongate_events_published_total{type=\"BlockRemoved\"}") >= 2.0,
        "{m}"
    );

    // The router example joins late: it catches up from the replay buffer and answers
    // which prefix this rank holds.
    let found: Vec<u64> = found.into_iter().collect();
    let all: Vec<u64> = (1000..1040).collect();
    let leading = all.iter().take_while(|h| found.contains(h)).count();
    let queries = [json!(found), json!(all)];
    let answers = router_answers(&endpoint, &replay, "array", &queries, &[], &logs);
    assert_eq!(answers[0]["best"], "r0", "{answers:?}");
    assert_eq!(
        answers[0]["ranks"][0]["prefix_blocks"],
        found.len(),
        "{answers:?}"
    );
    assert_eq!(
        answers[0]["ranks"][0]["media"],
        json!(["MEMORY"]),
        "{answers:?}"
    );
    assert_eq!(
        answers[1]["ranks"][0]["prefix_blocks"], leading,
        "{answers:?}"
    );
}

/// `tests/py/kv_events_sub.py` on moongate's endpoints, decoding `encoding`.
pub(crate) fn subscriber(
    endpoint: &str,
    replay: &str,
    encoding: &str,
    mg: &Moongate,
) -> Background {
    let dir = tempdir();
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("tests/py/kv_events_sub.py"))
        .args(["--endpoint", endpoint, "--replay", replay])
        .args(["--encoding", encoding, "--out"])
        .arg(dir.path().join("out.json"));
    Background::spawn("subscriber", cmd, dir, &[&mg.proc])
}

/// Every event the subscriber received, in order.
pub(crate) fn received(sub: &mut Background, mg: &Moongate) -> (Value, Vec<Value>) {
    wait_published(mg);
    let batches = mg.metric("moongate_events_batches_total");
    sub.step(&format!("finish {batches}"));
    let got: Value = serde_json::from_str(&std::fs::read_to_string(&sub.out).unwrap()).unwrap();
    let events = got["batches"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["events"].as_array().unwrap().clone())
        .collect();
    (got, events)
}

/// With the defaults (vLLM's map encoding, digests as vLLM's ints) and the embedded
/// default policy, keys named as vLLM's MooncakeStoreConnector names them publish what
/// vLLM's own events would say of those blocks: the chunk hash's low 64 bits, chained in
/// call order, with the key's `group_idx`; a subscriber on vLLM's current declared
/// structures reads them and the router example matches a prefix by them.
#[test]
fn vllm_connector_keys_publish_vllm_blocks_in_the_map_encoding() {
    let master = Master::start();
    // Hints come by POST and, from the router's own socket, by subscription.
    let hint_pub = format!("tcp://127.0.0.1:{}", free_port());
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n\
         [events]\nenabled = true\nendpoint = \"tcp://127.0.0.1:0\"\n\
         replay_endpoint = \"tcp://127.0.0.1:0\"\n\
         [hints]\nsubscribe = [\"{hint_pub}\"]\nsubscribe_topic = \"r0\"\n",
        master.rpc
    ));
    mg.wait_ready(&master);
    let (endpoint, replay) = endpoints(&mg);
    let mut sub = subscriber(&endpoint, &replay, "map", &mg);
    let logs = [&master.proc, &mg.proc];
    let work = Background::start("vllmkeys", &mg.listen, &master.metadata, &logs);
    let (got, events) = received(&mut sub, &mg);
    let r = work.finish();
    assert_eq!(*result(&r, "put0"), 0, "{r}");
    assert_eq!(*result(&r, "put1"), 0, "{r}");
    // vLLM's int form of a digest: its last 8 bytes, big-endian.
    let ints = |group: &str| -> Vec<u64> {
        result(&r, "hashes")[group]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| u64::from_str_radix(&h.as_str().unwrap()[48..], 16).unwrap())
            .collect()
    };
    let (g0, g1) = (ints("0"), ints("1"));
    let stored = |hashes: &[u64], group: u32| {
        json!({"type": "BlockStored", "hashes": hashes, "parent": null, "block_size": 16,
               "medium": "MEMORY", "group": group})
    };
    assert_eq!(
        events,
        [
            stored(&g0, 0),
            stored(&g1, 1),
            json!({"type": "BlockRemoved", "hashes": [g0[3]], "medium": "MEMORY", "group": 0}),
        ],
        "{got}\n{r}"
    );
    // `plain` names no block.
    assert_eq!(mg.metric("moongate_events_unmapped_keys_total"), 1.0);
    // The router also tells the picked rank's moongate that the query's blocks will be
    // read soon (its admin endpoint's POST /hints).
    let hints = format!("r0=http://{}/hints", mg.admin);
    let answers = router_answers(
        &endpoint,
        &replay,
        "map",
        &[json!(g0)],
        &["--hints", &hints],
        &logs,
    );
    assert_eq!(answers[0]["ranks"][0]["prefix_blocks"], 3, "{answers:?}");
    assert_eq!(answers[0]["hinted"], g0.len(), "{answers:?}");
    let upcoming = || mg.metric("moongate_hints_received_total{kind=\"upcoming\"}");
    assert_eq!(upcoming(), g0.len() as f64);
    // The same through the router's hint socket: it waits for moongate's subscription,
    // so the hint is not dropped, and exits once its socket delivered it (its input
    // ended, not stopped: see `router_answers`).
    let answers = router_answers(
        &endpoint,
        &replay,
        "map",
        &[json!(g0)],
        &["--hints-pub", &hint_pub],
        &logs,
    );
    assert_eq!(answers[0]["hinted"], g0.len(), "{answers:?}");
    wait_for(
        "published hints taken",
        Duration::from_secs(10),
        &logs,
        || upcoming() == 2.0 * g0.len() as f64,
    );
}

/// Runs `deploy/examples/kv_router.py` against one moongate (rank `r0`, events in
/// `encoding`, `hint_args` for its hints) and asks it one query per list of block
/// hashes; returns its answers.
fn router_answers(
    endpoint: &str,
    replay: &str,
    encoding: &str,
    queries: &[Value],
    hint_args: &[&str],
    logs: &[&Proc],
) -> Vec<Value> {
    let dir = tempdir();
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("deploy/examples/kv_router.py"))
        .args(["--rank", &format!("r0={endpoint},{replay}")])
        .args(["--encoding", encoding]);
    cmd.args(hint_args);
    let mut router = Background::spawn("router", cmd, dir, logs);
    let answers = queries
        .iter()
        .map(|q| {
            let line = router.ask(&q.to_string(), Duration::from_secs(30));
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
        })
        .collect();
    // Ended, not stopped: a hint it published just before its answer may still be in
    // its ZeroMQ socket, and a SIGTERM then loses it (seen in a quarter to a half of busy
    // runs: the connection closed with no message on the wire). It delivers what is
    // queued (up to its 5 s linger) and exits.
    router.end(Duration::from_secs(30));
    answers
}
