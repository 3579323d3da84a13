//! What access records cost the member that sends them, per lookup answer: finding
//! each key's home on an 8-member ring, splitting a 64-key answer by home, and adding
//! the other members' parts to their pending batches; and what a home pays to read a
//! batch. The request itself never waits on the network: batches leave on a timer.
//!
//! `cargo bench --bench fleet_records` (results in docs/results.md).

use std::sync::Arc;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use moongate::calls::Seen;
use moongate::codec::types::Uuid;
use moongate::fleet::forward::Forwarder;
use moongate::fleet::metrics::FleetMetrics;
use moongate::fleet::records::{self, Record, What};
use moongate::fleet::{FleetConfig, View};

fn key(i: usize) -> Bytes {
    // vLLM's MooncakeStoreConnector keys: model, ranks, group, a 64-hex chunk hash.
    Bytes::from(format!(
        "Qwen/Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:064x}"
    ))
}

fn forwarder(members: usize) -> Forwarder {
    let metrics = Arc::new(FleetMetrics::register(
        &mut prometheus_client::registry::Registry::default(),
    ));
    let f = Forwarder::new(
        &FleetConfig {
            ..Default::default()
        },
        "rank-0".into(),
        String::new(),
        metrics,
    );
    let mut view = View::default();
    for i in 0..members {
        let name = format!("rank-{i}");
        view.members.insert(
            name.clone(),
            moongate::fleet::Record {
                member: name,
                admin: format!("127.0.0.1:{}", 9000 + i),
                records: true,
                ..Default::default()
            },
        );
    }
    f.set_view(&view);
    f
}

fn records(c: &mut Criterion) {
    let tenant = Bytes::from_static(b"default");
    let keys: Vec<Bytes> = (0..64).map(key).collect();
    let f = forwarder(8);
    let mut g = c.benchmark_group("fleet records");
    g.bench_function("home of one key (8 members)", |b| {
        let homes = f.homes();
        let mut i = 0;
        b.iter(|| {
            i = (i + 1) % keys.len();
            homes.other(&tenant, &keys[i])
        })
    });
    g.bench_function("route a 64-key lookup answer (8 members)", |b| {
        let mut n = 0u32;
        b.iter(|| {
            // The sender takes the batches every flush (20 ms): here every 64 answers.
            n += 1;
            if n.is_multiple_of(64) {
                drop(f.take_pending());
            }
            let homes = f.homes();
            let seen = Seen::Found(keys.iter().map(|k| (k.clone(), None)).collect());
            let (mine, theirs) = records::split(seen, |k| homes.other(&tenant, k));
            for (h, s) in theirs {
                let r = Record {
                    tenant: tenant.clone(),
                    client: Uuid::default(),
                    arm: 0,
                    what: What::Seen(s),
                };
                f.queue(&homes, h, &r);
            }
            mine
        })
    });
    // A home's side: one member's batch of 100 such answers' parts.
    let mut batch = records::batch();
    for _ in 0..100 {
        let r = Record {
            tenant: tenant.clone(),
            client: Uuid::default(),
            arm: 0,
            what: What::Seen(Seen::Found(
                keys[..8].iter().map(|k| (k.clone(), None)).collect(),
            )),
        };
        records::encode(&mut batch, &r).unwrap();
    }
    let batch = batch.freeze();
    eprintln!(
        "a batch of 100 records of 8 keys: {} bytes ({:.1} per key)",
        batch.len(),
        batch.len() as f64 / 800.0
    );
    g.bench_function("decode 100 records of 8 keys", |b| {
        b.iter(|| records::decode(batch.clone()).unwrap().len())
    });
    g.finish();
}

criterion_group!(benches, records);
criterion_main!(benches);
