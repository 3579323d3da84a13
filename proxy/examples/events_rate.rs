//! KV events throughput, measured end to end inside one process: a producer thread
//! feeds key-table changes (one stored key each: the worst case, one event per key) at a
//! fixed rate into the same queue the master face feeds; the publisher task names them
//! with the embedded default plugin's `block-keys`, encodes and publishes them on a real
//! PUB socket; a SUB socket on loopback counts what arrives. Prints offered, published,
//! dropped and received events per second and the process CPU time.
//!
//! `cargo run --release --example events_rate [EVENTS_PER_S] [SECONDS]`
//! (`benches/run_events.sh` runs it with the master-face latency comparison.)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use moongate::codec::types::Tier;
use moongate::events::publisher::Publisher;
use moongate::events::{Change, Events, EventsConfig, What};
use moongate::metrics::Metrics;
use moongate::policy::PolicyConfig;
use moongate::policy::registry::Registry;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SubSocket};

fn cpu_seconds() -> f64 {
    // utime + stime of this process, in clock ticks (100 per second on Linux).
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit(')').next().unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // Fields after the command: state is not a number, so utime/stime are at 10/11.
    (f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0)) as f64 / 100.0
}

/// Events in one published message: `{"ts": ts, "events": [event, ...]}` (the default
/// map encoding).
fn events_in(payload: &[u8]) -> u64 {
    let mut rd = payload;
    let mut key = [0u8; 8];
    let _ = rmp::decode::read_map_len(&mut rd);
    let _ = rmp::decode::read_str(&mut rd, &mut key);
    let _ = rmp::decode::read_f64(&mut rd);
    let _ = rmp::decode::read_str(&mut rd, &mut key);
    rmp::decode::read_array_len(&mut rd).map_or(0, u64::from)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mut args = std::env::args().skip(1);
    let rate: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let secs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let metrics = Metrics::new();
    let registry = Registry::new(PolicyConfig::default(), None, metrics.policy.clone())
        .expect("embedded default policy");
    let cfg = EventsConfig {
        enabled: true,
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: "tcp://127.0.0.1:0".into(),
        ..EventsConfig::default()
    };
    let shutdown = CancellationToken::new();
    let publisher = Publisher::bind(&cfg, metrics.events.clone(), shutdown.clone())
        .await
        .expect("bind");
    let mut sub = SubSocket::new();
    sub.connect(&publisher.endpoint).await.expect("connect");
    sub.subscribe("").await.expect("subscribe");
    let received = Arc::new(AtomicU64::new(0));
    {
        let received = received.clone();
        tokio::spawn(async move {
            while let Ok(m) = sub.recv().await {
                if let Some(p) = m.get(2) {
                    received.fetch_add(events_in(p), Ordering::Relaxed);
                }
            }
        });
    }
    // Let the subscription reach the publisher before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (events, rx) = Events::new(&cfg, metrics.events.clone());
    let run = tokio::spawn(moongate::events::run(
        rx,
        publisher,
        registry,
        cfg.clone(),
        metrics.events.clone(),
        shutdown.clone(),
    ));
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let producer = std::thread::spawn(move || {
        // Paced per millisecond, as traffic arrives: not one burst.
        let per_ms = (rate / 1000).max(1);
        let mut i = 0u64;
        let end = Instant::now() + Duration::from_secs(secs);
        let mut tick = Instant::now();
        while Instant::now() < end {
            for _ in 0..per_ms {
                events.send(Change {
                    what: What::Stored,
                    arm: 0,
                    tier: Some(Tier::Memory),
                    keys: vec![Bytes::from(format!("bench/blk/{i}"))],
                });
                i += 1;
            }
            tick += Duration::from_millis(1);
            if let Some(d) = tick.checked_duration_since(Instant::now()) {
                std::thread::sleep(d);
            }
        }
        i
    });
    let offered = producer.join().expect("producer");
    let m = &metrics.events;
    let deadline = Instant::now() + Duration::from_secs(30);
    while m.handled.get() + m.dropped.get() < offered && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    // Whatever is still on the wire to the subscriber.
    let mut last = u64::MAX;
    while received.load(Ordering::Relaxed) != last {
        last = received.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    let _ = run.await;
    let published: u64 = m.published.iter().map(|c| c.get()).sum();
    println!(
        "offered    {offered} events in {elapsed:.2} s ({:.0}/s)",
        offered as f64 / elapsed
    );
    println!("published  {published} in {} batches", m.batches.get());
    println!("dropped    {} (queue full)", m.dropped.get());
    println!("unmapped   {}", m.unmapped.get());
    println!(
        "received   {} by the subscriber ({:.1} %)",
        received.load(Ordering::Relaxed),
        100.0 * received.load(Ordering::Relaxed) as f64 / offered.max(1) as f64
    );
    println!(
        "cpu        {cpu:.2} s for the whole process ({:.2} us per event, producer and subscriber included)",
        cpu * 1e6 / offered.max(1) as f64
    );
}
