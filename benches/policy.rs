//! Cost of one policy decision through the wasmtime host, with real plugin components:
//! a single put, a 64-key batch put, a 1,000-candidate eviction, a 64-key lookup; the
//! whole `decide` path of a put (view, call, action); activating an already-loaded plugin;
//! and how long a call can be held up by swaps happening meanwhile.
//!
//! `cargo bench --bench policy` (results in docs/results.md).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use moongate::codec::message::{BatchPutStartArgs, PutStartArgs, Request};
use moongate::codec::types::{ReplicateConfig, Uuid};
use moongate::config::{PluginSpec, PolicyConfig};
use moongate::metrics::Metrics;
use moongate::policy::host::{HostLimits, Plugin, PolicyEngine, wit};
use moongate::policy::registry::Registry;
use moongate::policy::{pack_keys, put_view};

fn plugin(e: &Arc<PolicyEngine>, name: &str) -> Arc<Plugin> {
    let p = moongate::policy::registry::built_plugin(name);
    e.load(name, &std::fs::read(p).unwrap(), b"", None).unwrap()
}

fn key(i: usize) -> Bytes {
    // ~40-byte keys, like vLLM's block-hash keys
    Bytes::from(format!("kv/model-llama3-70b/tp0/{i:016x}"))
}

fn batch_request(n: usize) -> Request {
    Request::BatchPutStart(BatchPutStartArgs {
        client_id: Uuid {
            first: 1,
            second: 2,
        },
        keys: (0..n).map(key).collect(),
        slice_lengths: vec![256 << 10; n],
        config: ReplicateConfig::default(),
        tenant_id: Bytes::from_static(b"default"),
    })
}

fn single_request() -> Request {
    Request::PutStart(PutStartArgs {
        client_id: Uuid {
            first: 1,
            second: 2,
        },
        key: key(7),
        slice_length: 256 << 10,
        config: ReplicateConfig::default(),
        tenant_id: Bytes::from_static(b"default"),
    })
}

fn host(c: &mut Criterion) {
    let e = PolicyEngine::new(
        HostLimits {
            call_timeout: Duration::from_millis(10),
            memory_bytes: 16 << 20,
            max_instances: 16,
        },
        Metrics::new().policy.plugins.clone(),
    )
    .unwrap();
    let lru = plugin(&e, "lru");
    let single = put_view(&single_request()).unwrap().to_wit();
    let batch_req = batch_request(64);
    let batch = put_view(&batch_req).unwrap().to_wit();
    let mut g = c.benchmark_group("host");
    g.bench_function("on_put single key", |b| {
        b.iter(|| lru.on_put(&single).unwrap())
    });
    g.bench_function("on_put 64 keys (call only)", |b| {
        b.iter(|| lru.on_put(&batch).unwrap())
    });
    g.bench_function("on_put 64 keys (pack + call)", |b| {
        b.iter(|| lru.on_put(&put_view(&batch_req).unwrap().to_wit()).unwrap())
    });
    let keys: Vec<Bytes> = (0..1000).map(key).collect();
    let evict = wit::EvictCall {
        keys: pack_keys(keys.iter()),
        sizes: (0..1000).map(|i| 4096 + (i % 7) * 1024).collect(),
        tiers: vec![wit::Tier::Memory; 1000],
        age_ms: (0..1000).map(|i| (i * 7919) % 100_000).collect(),
        hits: (0..1000).map(|i| (i % 13) as u32).collect(),
        bytes_needed: 1 << 20,
    };
    g.bench_function("evict 1000 candidates", |b| {
        b.iter(|| lru.evict(&evict).unwrap())
    });
    let lookup = wit::LookupCall {
        keys: pack_keys(keys[..64].iter()),
        counts: vec![2; 64],
        tiers: (0..128)
            .map(|i| {
                if i % 2 == 0 {
                    wit::Tier::Disk
                } else {
                    wit::Tier::Memory
                }
            })
            .collect(),
        sizes: vec![256 << 10; 128],
    };
    g.bench_function("on_lookup 64 keys x 2 replicas", |b| {
        b.iter(|| lru.on_lookup(&lookup).unwrap())
    });
    g.finish();
    let bytes = std::fs::read(
        std::path::Path::new(env!("MOONGATE_PLUGIN_DIR")).join("tier-placement.wasm"),
    )
    .unwrap();
    let mut g = c.benchmark_group("load");
    g.sample_size(10);
    g.bench_function(
        "tier-placement: compile + instantiate + configure + conformance",
        |b| b.iter(|| e.load("tp", &bytes, b"", None).unwrap()),
    );
    g.finish();
}

fn registry() -> Arc<Registry> {
    let dir = env!("MOONGATE_PLUGIN_DIR");
    let spec = |name: &str, file: &str| PluginSpec {
        name: name.into(),
        path: Some(format!("{dir}/{file}.wasm")),
        from: None,
        sha256: None,
        config: String::new(),
    };
    Registry::new(
        PolicyConfig {
            active: "lru".into(),
            plugins: vec![spec("lru", "lru"), spec("tiers", "tier-placement")],
            ..PolicyConfig::default()
        },
        None,
        Metrics::new().policy.clone(),
    )
    .unwrap()
}

fn face_path(c: &mut Criterion) {
    let r = registry();
    let single = single_request();
    let batch = batch_request(64);
    let mut g = c.benchmark_group("decide_put");
    g.bench_function("single key", |b| {
        b.iter(|| {
            let set = r.current();
            r.decide(&set, &single, None)
        })
    });
    g.bench_function("64-key batch", |b| {
        b.iter(|| {
            let set = r.current();
            r.decide(&set, &batch, None)
        })
    });
    g.finish();
    let mut g = c.benchmark_group("swap");
    let mut i = 0usize;
    g.bench_function("activate a loaded plugin", |b| {
        b.iter(|| {
            i += 1;
            r.activate(["lru", "tiers"][i % 2]).unwrap()
        })
    });
    g.finish();
}

/// The longest a decision took while another thread swapped plugins back and forth.
fn stall_under_swaps() {
    let r = registry();
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (r, stop) = (r.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                r.activate(["lru", "tiers"][(n % 2) as usize]).unwrap();
                n += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
            n
        })
    };
    let req = batch_request(64);
    let mut lat = Vec::with_capacity(200_000);
    let end = Instant::now() + Duration::from_secs(3);
    while Instant::now() < end {
        let t = Instant::now();
        let set = r.current();
        r.decide(&set, &req, None);
        lat.push(t.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    lat.sort();
    let q = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    println!(
        "stall under swaps: {} decisions (64 keys) during {swaps} swaps: p50 {:?}, p99 {:?}, p99.9 {:?}, max {:?}",
        lat.len(),
        q(0.5),
        q(0.99),
        q(0.999),
        lat[lat.len() - 1]
    );
}

fn stall(_c: &mut Criterion) {
    stall_under_swaps();
}

criterion_group!(benches, host, face_path, stall);
criterion_main!(benches);
