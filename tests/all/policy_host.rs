//! The policy host with real plugin components (built from `plugins/` by build.rs):
//! decisions, fault containment (trap, endless loop, unbounded allocation, bad answers,
//! refused or trapping configure, garbage bytes, a sha256 pin), and the registry's swap,
//! rollback and experiment assignment.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use moongate::codec::message::{BatchPutStartArgs, PutStartArgs, Request};
use moongate::codec::types::{ReplicateConfig, Uuid};
use moongate::config::{PluginSpec, PolicyConfig};
use moongate::metrics::Metrics;
use moongate::policy::experiment::{ArmSpec, ExperimentSpec};
use moongate::policy::host::{CallError, HostLimits, LoadError, Plugin, PolicyEngine, wit};
use moongate::policy::registry::{Registry, RegistryError};
use moongate::policy::{PutAction, put_view};

fn plugin_bytes(name: &str) -> Vec<u8> {
    let p = crate::support::plugin_path(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn engine() -> Arc<PolicyEngine> {
    PolicyEngine::new(
        HostLimits {
            call_timeout: Duration::from_millis(20),
            memory_bytes: 8 << 20,
            max_instances: 32,
        },
        Metrics::new().policy.plugins.clone(),
    )
    .unwrap()
}

fn load(e: &Arc<PolicyEngine>, name: &str, config: &str) -> Result<Arc<Plugin>, LoadError> {
    e.load(name, &plugin_bytes(name), config.as_bytes(), None)
}

fn put(key: &str, size: u64) -> Request {
    Request::PutStart(PutStartArgs {
        client_id: Uuid {
            first: 7,
            second: 9,
        },
        key: Bytes::copy_from_slice(key.as_bytes()),
        slice_length: size,
        config: ReplicateConfig::default(),
        tenant_id: Bytes::from_static(b"default"),
    })
}

fn wit_call(req: &Request) -> wit::PutCall {
    put_view(req).unwrap().to_wit()
}

#[test]
fn default_plugin_admits_everything_unchanged() {
    let e = engine();
    let p = e
        .load(
            "default",
            moongate::policy::registry::DEFAULT_PLUGIN,
            b"",
            None,
        )
        .unwrap();
    let req = put("k", 10);
    let d = p.on_put(&wit_call(&req)).unwrap();
    assert!(d.config.is_none() && d.admissions.is_empty());
    assert!(matches!(
        moongate::policy::put_action(&req, &d),
        PutAction::Forward
    ));
}

#[test]
fn tier_placement_rewrites_and_denies_by_rule() {
    let e = engine();
    let p = load(
        &e,
        "tier-placement",
        r#"{"rules": [
            {"key_prefix": "hot/", "segment": "127.0.0.1:1111", "replicas": 2},
            {"min_size": 1000000, "soft_pin_ttl_ms": 60000},
            {"key_prefix": "tmp/", "deny": -200}
        ]}"#,
    )
    .unwrap();
    let req = put("hot/a", 10);
    let d = p.on_put(&wit_call(&req)).unwrap();
    let c = d.config.unwrap();
    assert_eq!(c.preferred_segment, "127.0.0.1:1111");
    assert_eq!(c.replica_num, 2);
    let d = p.on_put(&wit_call(&put("big", 2_000_000))).unwrap();
    assert_eq!(d.config.unwrap().soft_pin_ttl_ms, Some(60000));
    let d = p.on_put(&wit_call(&put("cold/x", 10))).unwrap();
    assert!(d.config.is_none());
    // a batch: per-key denial, one config from the first admitted key's rule
    let batch = Request::BatchPutStart(BatchPutStartArgs {
        client_id: Uuid::default(),
        keys: ["tmp/1", "hot/2", "tmp/3"]
            .map(|k| Bytes::from_static(k.as_bytes()))
            .to_vec(),
        slice_lengths: vec![1, 2, 3],
        config: ReplicateConfig::default(),
        tenant_id: Bytes::from_static(b"default"),
    });
    let d = p.on_put(&wit_call(&batch)).unwrap();
    let PutAction::Rewrite {
        request,
        fixup: Some(f),
    } = moongate::policy::put_action(&batch, &d)
    else {
        panic!("expected a partial denial");
    };
    let Request::BatchPutStart(a) = *request else {
        panic!("a batch stays a batch");
    };
    assert_eq!(a.keys, vec![Bytes::from_static(b"hot/2")]);
    assert_eq!(&a.config.preferred_segment[..], b"127.0.0.1:1111");
    assert_eq!(f.denied.len(), 2);
    // bad config is refused at load
    assert!(matches!(
        load(&e, "tier-placement", r#"{"rules": [{"nope": 1}]}"#),
        Err(LoadError::Refused(_))
    ));
}

#[test]
fn a_trap_is_contained_and_the_next_call_gets_a_fresh_instance() {
    let e = engine();
    let p = load(&e, "fault", "every-3-trap").unwrap();
    // traffic starts on a fresh instance (conformance left no state): calls 1, 2 ok,
    // 3 traps, then a fresh instance counts anew
    let c = wit_call(&put("k", 1));
    assert!(p.on_put(&c).is_ok());
    assert!(p.on_put(&c).is_ok());
    assert!(matches!(p.on_put(&c), Err(CallError::Trap(_))));
    assert!(p.on_put(&c).is_ok());
    assert!(p.on_put(&c).is_ok());
    assert!(matches!(p.on_put(&c), Err(CallError::Trap(_))));
}

#[test]
fn faulty_guests_fail_cleanly_and_others_keep_working() {
    let e = engine();
    let good = load(&e, "tier-placement", "").unwrap();
    let c = wit_call(&put("k", 1));
    // These fail their conformance call, so they never load.
    for (mode, want) in [
        ("trap", "trap"),
        ("loop", "timeout"),
        ("oom", "oom"),
        ("bad-answer", "invalid"),
    ] {
        let started = thread_cpu();
        match load(&e, "fault", mode) {
            Err(LoadError::Conformance { error, .. }) => {
                assert_eq!(error.kind(), want, "{mode}: {error}")
            }
            other => panic!("{mode}: expected a conformance failure, got {other:?}"),
        }
        // A loop is stopped by the epoch deadline, not by luck. Bounded by the CPU time
        // this thread spent, not the wall clock: a busy machine stretched the 2 s setup
        // deadline to 5.1-5.7 s of wall time (the loop was stopped all the same), while
        // a loop that nothing stopped would burn CPU past any bound.
        let spent = thread_cpu() - started;
        assert!(
            spent < Duration::from_secs(5),
            "{mode} took {spent:?} of CPU"
        );
        assert!(
            good.on_put(&c).is_ok(),
            "a healthy plugin still answers after {mode}"
        );
    }
    assert!(matches!(
        load(&e, "fault", "refuse-config"),
        Err(LoadError::Refused(_))
    ));
    assert!(matches!(
        load(&e, "fault", "trap-config"),
        Err(LoadError::Configure(CallError::Trap(_)))
    ));
    assert!(matches!(
        e.load("junk", b"\0asm garbage", b"", None),
        Err(LoadError::Compile(_))
    ));
    assert!(matches!(
        e.load("x", &plugin_bytes("default"), b"", Some("00ff")),
        Err(LoadError::ShaMismatch { .. })
    ));
}

fn registry(cfg: PolicyConfig) -> Arc<Registry> {
    Registry::new(cfg, None, Metrics::new().policy.clone()).unwrap()
}

fn specs() -> Vec<PluginSpec> {
    let dir = env!("MOONGATE_PLUGIN_DIR");
    vec![
        PluginSpec {
            name: "tiers".into(),
            path: Some(format!("{dir}/tier-placement.wasm")),
            from: None,
            sha256: None,
            config: r#"{"rules": [{"segment": "127.0.0.1:9"}]}"#.into(),
        },
        PluginSpec {
            name: "flaky".into(),
            path: None,
            from: None,
            sha256: None,
            config: "every-2-trap".into(),
        },
    ]
}

#[test]
fn swap_rollback_and_states() {
    let r = registry(PolicyConfig {
        plugins: specs(),
        ..PolicyConfig::default()
    });
    let state = |n: &str| r.info(n).map(|i| i.state).unwrap_or_default();
    assert_eq!(state("default"), "active");
    assert_eq!(state("tiers"), "loaded");
    let held = r.current(); // a call in flight holds its set
    r.activate("tiers").unwrap();
    assert_eq!(state("tiers"), "active");
    assert_eq!(state("default"), "last-good");
    assert_eq!(
        held.arms[0].plugin.name(),
        "default",
        "in-flight call keeps its version"
    );
    r.rollback("test").unwrap();
    assert_eq!(state("default"), "active");
    assert!(matches!(
        r.rollback("again"),
        Err(RegistryError::NoLastGood)
    ));
    // a rejected upload records its reason and leaves the active set alone
    assert!(r.load("broken", b"not wasm", None).is_err());
    assert_eq!(state("broken"), "rejected");
    assert!(r.info("broken").unwrap().reason.is_some());
    assert_eq!(r.current().arms[0].plugin.name(), "default");
    assert!(matches!(
        r.activate("nope"),
        Err(RegistryError::UnknownPlugin(_))
    ));
}

#[test]
fn a_plugin_that_keeps_failing_after_activation_is_rolled_back() {
    let mut cfg = PolicyConfig {
        plugins: specs(),
        ..PolicyConfig::default()
    };
    cfg.rollback.min_calls = 10;
    let r = registry(cfg);
    r.load("flaky", &plugin_bytes("fault"), None).unwrap();
    r.activate("flaky").unwrap();
    let req = put("k", 1);
    for _ in 0..20 {
        let set = r.current();
        // fail-open: every call is forwarded whole even when the plugin traps
        let d = r.decide(&set, &req, None);
        assert!(d.by_plugin() && d.refused().is_none());
    }
    assert_eq!(r.current().arms[0].plugin.name(), "default", "rolled back");
}

#[test]
fn experiment_assignment_follows_the_weights() {
    let r = registry(PolicyConfig {
        plugins: specs(),
        ..PolicyConfig::default()
    });
    r.set_experiment(ExperimentSpec {
        assign: moongate::policy::experiment::Assign::Key,
        control: None,
        arms: vec![
            ArmSpec {
                name: "a".into(),
                plugin: "default".into(),
                weight: 30,
            },
            ArmSpec {
                name: "b".into(),
                plugin: "tiers".into(),
                weight: 70,
            },
        ],
        guardrail: Default::default(),
        capacity: Default::default(),
    })
    .unwrap();
    let set = r.current();
    let n = 10_000;
    let b = (0..n)
        .filter(|i| set.pick(&Uuid::default(), Some(&Bytes::from(format!("key/{i}")))) == 1)
        .count();
    let share = b as f64 / n as f64;
    assert!((share - 0.7).abs() < 0.02, "arm b got {share}");
    assert!(matches!(
        r.set_experiment(ExperimentSpec {
            assign: Default::default(),
            control: Some("zz".into()),
            arms: vec![ArmSpec {
                name: "a".into(),
                plugin: "default".into(),
                weight: 1
            }],
            guardrail: Default::default(),
            capacity: Default::default(),
        }),
        Err(RegistryError::BadExperiment(_))
    ));
}

#[test]
fn latency_guardrail_stops_an_arm_and_its_traffic_goes_to_control() {
    let r = registry(PolicyConfig {
        plugins: specs(),
        ..PolicyConfig::default()
    });
    r.set_experiment(ExperimentSpec {
        assign: moongate::policy::experiment::Assign::Key,
        control: Some("base".into()),
        arms: vec![
            ArmSpec {
                name: "base".into(),
                plugin: "default".into(),
                weight: 50,
            },
            ArmSpec {
                name: "slow".into(),
                plugin: "tiers".into(),
                weight: 50,
            },
        ],
        guardrail: moongate::policy::experiment::Guardrail {
            max_error_ratio: 1.0,
            max_mean_latency_ms: 1.0,
            window_ms: 60_000,
            min_calls: 5,
        },
        capacity: Default::default(),
    })
    .unwrap();
    let set = r.current();
    let fast = Duration::from_micros(200);
    for _ in 0..5 {
        set.note_outcome(1, false, Some(fast));
    }
    assert!(!set.arms[1].is_stopped(), "within budget");
    for _ in 0..20 {
        set.note_outcome(1, false, Some(Duration::from_millis(5)));
    }
    assert!(set.arms[1].is_stopped(), "mean latency over budget");
    let picks: Vec<usize> = (0..200)
        .map(|i| set.pick(&Uuid::default(), Some(&Bytes::from(format!("k{i}")))))
        .collect();
    assert!(picks.iter().all(|&a| a == 0), "all traffic on control");
}

/// The contract grew (`block-keys`, WIT 0.1.1) without breaking what was built before:
/// a component built for 0.1.0 (`proxy/tests/fixtures/plugins`) loads, decides, and has
/// no blocks to name; the same plugin built today names them.
#[test]
fn a_plugin_built_for_wit_0_1_0_still_loads() {
    let e = engine();
    let old = std::fs::read(
        crate::support::repo_root().join("proxy/tests/fixtures/plugins/lru-wit-0.1.0.wasm"),
    )
    .unwrap();
    let p = e.load("lru-0.1.0", &old, b"", None).unwrap();
    let keys = wit::PackedKeys {
        bytes: b"a/blk/1a/blk/2".to_vec(),
        ends: vec![7, 14],
    };
    let victims = p
        .evict(&wit::EvictCall {
            keys: keys.clone(),
            sizes: vec![10, 10],
            tiers: vec![wit::Tier::Memory, wit::Tier::Memory],
            age_ms: vec![5, 50],
            hits: vec![0, 0],
            bytes_needed: 10,
        })
        .unwrap();
    assert_eq!(victims, [1], "the older block goes first");
    assert!(p.block_keys(&keys).unwrap().is_none());

    let new = load(&e, "lru", "").unwrap();
    let blocks = new.block_keys(&keys).unwrap().unwrap();
    let got: Vec<(u64, Option<u64>)> = blocks
        .iter()
        .map(|b| b.as_ref().map(|b| (b.hash, b.parent)).unwrap())
        .collect();
    assert_eq!(got, [(1, None), (2, Some(1))]);
}

/// The contract grew again (`evict-tiered`, WIT 0.1.2): a component built for 0.1.1
/// (`proxy/tests/fixtures/plugins`) loads and names blocks, has no tiered eviction (its
/// victims lose their memory copies only); the lru plugin built today chooses per tier
/// from its config: cold victims on an SSD lose the whole key.
#[test]
fn a_plugin_built_for_wit_0_1_1_still_loads_and_tiers_are_chosen_today() {
    let e = engine();
    let old = std::fs::read(
        crate::support::repo_root().join("proxy/tests/fixtures/plugins/lru-wit-0.1.1.wasm"),
    )
    .unwrap();
    let p = e.load("lru-0.1.1", &old, b"", None).unwrap();
    let keys = wit::PackedKeys {
        bytes: b"a/blk/1a/blk/2".to_vec(),
        ends: vec![7, 14],
    };
    let call = wit::TieredEvictCall {
        call: wit::EvictCall {
            keys: keys.clone(),
            sizes: vec![10, 10],
            tiers: vec![wit::Tier::Memory, wit::Tier::Memory],
            age_ms: vec![5, 500],
            hits: vec![0, 0],
            bytes_needed: 20,
        },
        on_disk: vec![true, true],
    };
    assert!(p.block_keys(&keys).unwrap().is_some(), "0.1.1 names blocks");
    assert!(p.evict_tiered(&call).unwrap().is_none());
    assert_eq!(p.evict(&call.call).unwrap(), [1, 0]);

    let scopes = |config: &str| -> Vec<(u32, bool)> {
        let new = load(&e, "lru", config).unwrap();
        new.evict_tiered(&call)
            .unwrap()
            .expect("built for 0.1.2")
            .iter()
            .map(|v| (v.index, v.scope == wit::EvictScope::All))
            .collect()
    };
    assert_eq!(scopes(""), [(1, false), (0, false)], "memory copies only");
    assert_eq!(
        scopes(r#"{"whole_key_after_ms": 100}"#),
        [(1, true), (0, false)],
        "the cold victim loses its SSD copy too"
    );
    assert!(
        load(&e, "lru", r#"{"whole_key_after": 1}"#).is_err(),
        "an unknown config key is refused"
    );
}

/// The contract grew a third time (`block-refs`, WIT 0.1.3: hashes of any width and the
/// KV-cache group): a component built for 0.1.2 loads and names its `blk` keys as 64-bit
/// blocks through `block-keys`, and no vLLM connector key; the default policy built today
/// names vLLM MooncakeStoreConnector keys by their chunk hash's bytes and group, each
/// chained to the chunk before it in the call.
#[test]
fn a_plugin_built_for_wit_0_1_2_still_loads_and_the_default_names_vllm_keys() {
    let e = engine();
    let old = std::fs::read(
        crate::support::repo_root().join("proxy/tests/fixtures/plugins/lru-wit-0.1.2.wasm"),
    )
    .unwrap();
    let p = e.load("lru-0.1.2", &old, b"", None).unwrap();
    let (h1, h2) = ("ab".repeat(32), "cd".repeat(32));
    let vllm = |g: u32, h: &str| format!("m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:{g}@{h}");
    let keys = moongate::policy::pack_keys(
        [vllm(0, &h1), vllm(0, &h2), vllm(1, &h2), "a/blk/9".into()].iter(),
    );
    // Per key: its hash, parent and group, hashes as decimal ints or hex digests.
    type Named = Option<(String, Option<String>, Option<u32>)>;
    let named = |p: &Plugin| -> Vec<Named> {
        let show = |h: &wit::BlockHash| match h {
            wit::BlockHash::Int(v) => v.to_string(),
            wit::BlockHash::Digest(d) => d.iter().map(|b| format!("{b:02x}")).collect(),
        };
        p.blocks(&keys)
            .unwrap()
            .expect("names blocks")
            .iter()
            .map(|b| {
                b.as_ref()
                    .map(|b| (show(&b.hash), b.parent.as_ref().map(show), b.group))
            })
            .collect()
    };
    assert_eq!(
        named(&p),
        [None, None, None, Some(("9".into(), None, None))],
        "0.1.2 names blk keys only"
    );
    let default = load(&e, "default", "").unwrap();
    assert_eq!(
        named(&default),
        [
            Some((h1.clone(), None, Some(0))),
            Some((h2.clone(), Some(h1), Some(0))),
            Some((h2, None, Some(1))),
            Some(("9".into(), None, None)),
        ]
    );
}

/// The contract grew a fourth time (`evict-hinted`, WIT 0.1.4: eviction that reads the
/// serving stack's hints): a component built for 0.1.3 loads and evicts as before, hints
/// unseen; `hint-lru` built today puts the `done` block first and the `upcoming` one
/// last, and `lru` built today (the SDK's default `evict-hinted`) keeps its LRU order.
#[test]
fn a_plugin_built_for_wit_0_1_3_still_loads_and_hints_reach_a_plugin_that_reads_them() {
    let e = engine();
    let old = std::fs::read(
        crate::support::repo_root().join("proxy/tests/fixtures/plugins/lru-wit-0.1.3.wasm"),
    )
    .unwrap();
    let p = e.load("lru-0.1.3", &old, b"", None).unwrap();
    let hint = |kind, age_ms, due_in_ms| wit::CandidateHint {
        kind,
        age_ms,
        due_in_ms,
    };
    let call = wit::HintedEvictCall {
        call: wit::EvictCall {
            keys: moongate::policy::pack_keys(["a", "b", "c"].iter()),
            sizes: vec![10, 10, 10],
            tiers: vec![wit::Tier::Memory; 3],
            age_ms: vec![900, 500, 100],
            hits: vec![0; 3],
            bytes_needed: 30,
        },
        on_disk: Vec::new(),
        hints: vec![
            hint(wit::HintKind::Upcoming, 10, 50),
            hint(wit::HintKind::None, 0, 0),
            hint(wit::HintKind::Done, 50, 0),
        ],
    };
    assert!(!p.reads_hints() && p.evict_hinted(&call).unwrap().is_none());
    assert_eq!(p.evict(&call.call).unwrap(), [0, 1, 2], "LRU as before");
    let order = |p: &Plugin| -> Vec<u32> {
        p.evict_hinted(&call)
            .unwrap()
            .expect("built for 0.1.4")
            .iter()
            .map(|v| v.index)
            .collect()
    };
    let hinted = load(&e, "hint-lru", "").unwrap();
    assert!(hinted.reads_hints());
    assert_eq!(order(&hinted), [2, 1, 0], "done first, upcoming last");
    let lru = load(&e, "lru", "").unwrap();
    assert_eq!(order(&lru), [0, 1, 2], "the SDK's default reads no hints");
    assert!(load(&e, "hint-lru", r#"{"max_wrong_share": 2}"#).is_err());
}

/// CPU time this thread has used (CLOCK_THREAD_CPUTIME_ID): unlike the wall clock, it
/// does not grow while other work holds the machine's cores.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, which `ts` is.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
