//! Bytes per key of the eviction table and the miss history, measured: inserts N keys of
//! a given length into each and reads the process's resident memory (/proc/self/statm)
//! before and after. `cargo run --release --example key_memory [N] [KEY_BYTES]`.

use bytes::Bytes;
use moongate::keys::{History, KeyTable, Tier, Why};

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn keys(n: usize, len: usize) -> Vec<Bytes> {
    (0..n)
        .map(|i| {
            let mut k = format!("vllm@model@tp0@{i:016x}@").into_bytes();
            k.resize(len.max(k.len()), b'x');
            Bytes::from(k)
        })
        .collect()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let len: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(100);
    let tenant = Bytes::from_static(b"default");

    let ks = keys(n, len);
    let before = rss_bytes();
    let table = KeyTable::new(n, 0);
    for chunk in ks.chunks(64) {
        let batch: Vec<(Bytes, u64, Tier)> = chunk
            .iter()
            .map(|k| (k.clone(), 65536, Tier::Memory))
            .collect();
        table.put(&tenant, &batch, 0, 1);
    }
    let after_table = rss_bytes();
    let history = History::new(n);
    for chunk in ks.chunks(64) {
        history.note(&tenant, chunk.iter(), Why::evicted_by_moongate, 0, 1);
    }
    let after_history = rss_bytes();
    println!(
        "{n} keys of {len} bytes: key table {:.0} bytes/key, miss history {:.0} bytes/key \
         (resident memory; each holds its own copy of the key)",
        (after_table - before) as f64 / n as f64,
        (after_history - after_table) as f64 / n as f64
    );
    assert_eq!(table.len(), n);
    assert_eq!(history.len(), n);
}
